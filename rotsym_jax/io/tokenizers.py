"""A checkpoint's tokenizer, read without running any code: a downloaded folder is untrusted, and
one whose tokenizer names code of its own (`auto_map`) is refused by name before transformers
sees it (transformers would ask on standard input whether to run it). transformers is then told
never to run code and never to reach the Hub."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError
from ._files import json_object_or_empty

# The files where transformers looks for a tokenizer's own code.
CODE_SOURCES = ("tokenizer_config.json", "config.json")


def named_code(folder: Path) -> str | None:
    """Where `folder`'s tokenizer names code of its own ("file: auto_map[...] = ..."), else None."""
    for name in CODE_SOURCES:
        auto_map = json_object_or_empty(Path(folder) / name).get("auto_map")
        if isinstance(auto_map, dict) and auto_map.get("AutoTokenizer"):
            return f"{name}: auto_map['AutoTokenizer'] = {json.dumps(auto_map['AutoTokenizer'])[:200]}"
        if name == "tokenizer_config.json" and isinstance(auto_map, list) and any(auto_map):  # the older form: [slow, fast]
            return f"{name}: auto_map = {json.dumps(auto_map)[:200]}"
    return None


def load_tokenizer(folder, purpose: str, error: type[Exception] = InputError):
    """transformers' tokenizer of the checkpoint folder `folder`, to `purpose` (said in refusals);
    `error` where it names code of its own or transformers cannot read it."""
    import transformers

    folder = Path(folder)
    code = named_code(folder)
    if code is not None:
        raise error(f"{folder}: its tokenizer names code of its own ({code}), which rotsym never runs; to {purpose}, "
                         "tokenize the texts with a tokenizer you trust and give the token ids instead (an .npz with "
                         "input_ids and attention_mask)")
    try:
        return transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as e:
        raise error(f"{folder}: no tokenizer to {purpose} ({e})") from None


def vocabulary(tokenizer, rows: int) -> dict[str, int]:
    """`tokenizer`'s token -> id for the ids a table of `rows` rows holds (mergekit leaves out the
    tokens past a model's vocab_size)."""
    return {token: i for token, i in tokenizer.get_vocab().items() if i < rows}


def output_tokenizer(donor, tokenizers: list, rows: list[int], *, union: bool, added: list[str]):
    """The output's tokenizer, as mergekit 0.1.5 builds it (a copy; `donor` is not changed): the
    donor's (tokenizer_source: base, or that model's), with, for `union`, every token of
    `tokenizers` (with `rows`: each one's table size) it lacks, then their added tokens (special
    ones with their settings), then the config's `added` tokens it lacks. mergekit takes the models
    and their tokens in the order of a hash; here the config's models in order, each one's tokens by
    id. Returns (the tokenizer, whether it differs from the donor's)."""
    import copy

    out = copy.deepcopy(donor)
    plain, special = [], {}
    for tokenizer, size in zip(tokenizers if union else [], rows):
        decoder = tokenizer.added_tokens_decoder
        for token, i in sorted(vocabulary(tokenizer, size).items(), key=lambda item: item[1]):
            if i not in decoder and token not in plain:
                plain.append(token)
        for i, info in sorted(decoder.items()):
            if i < size:
                special.setdefault(info.content, info)
    before = out.get_vocab()
    decoder = {info.content: info for info in donor.added_tokens_decoder.values()}
    changed = False
    for token in plain:
        if token not in before and token not in special:
            changed |= out.add_tokens(token) > 0
    for content, info in special.items():
        if decoder.get(content) != info:  # the donor's own added tokens, as they are, are no change
            out.add_tokens(info)
            changed = True
    for token in added:
        if token not in out.get_vocab():
            changed |= out.add_tokens(token) > 0
    return out, changed


def tokenizer_files(tokenizer) -> dict[str, str]:
    """{file name: text} of `tokenizer` as transformers saves it (its fast form: tokenizer.json)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {p.name: p.read_text() for p in Path(folder).iterdir() if p.is_file()}
