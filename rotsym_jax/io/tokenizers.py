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
