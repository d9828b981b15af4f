"""Build the tiny-chat byte-level BPE tokenizer (sluice/models/tiny-chat/tokenizer.json).

Two steps, both deterministic:
  python -m sluice.models.build_tokenizer corpus   # regenerate sluice/models/corpus.txt (needs ../shared)
  python -m sluice.models.build_tokenizer build    # train tokenizer.json from the committed corpus
The corpus is committed so `build` reproduces the committed tokenizer.json on any machine;
`corpus` depends on the interpreter's stdlib sources, so it is rerun only on purpose.

Special tokens take the lowest ids (see SPECIAL_TOKENS); <|endoftext|> (id 0) is the model's
end_id and <|pad|> (id 1) pads batches. Byte-level BPE covers every byte, so any UTF-8 text
round-trips: decode(encode(s)) == s.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

MODELS_DIR = Path(__file__).resolve().parent
REPO_ROOT = MODELS_DIR.parent.parent  # run from a checkout: ../shared holds the seeds
SHARED_DIR = REPO_ROOT.parent / "shared"
CORPUS_PATH = MODELS_DIR / "corpus.txt"
TOKENIZER_PATH = MODELS_DIR / "tiny-chat" / "tokenizer.json"

VOCAB_SIZE = 4096
# Order fixes the ids: index in this tuple == token id.
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
END_ID = 0
PAD_ID = 1

# Stdlib docstrings are English prose about software, close to what a demo chat sends; the
# corpus stops growing here so the committed file stays well under 1 MB.
STDLIB_BUDGET_CHARS = 640_000

# Non-ASCII lines so frequent multi-byte characters get merges of their own (bytes alone would
# already round-trip; these only make such text cheaper in tokens).
MULTILINGUAL = """\
Le système accepte la requête et renvoie un identifiant d'exécution.
Die Anfrage wurde angenommen; das Kontingent des Mandanten ist erschöpft.
La réplica se reinició a mitad de la respuesta: la ejecución quedó interrumpida.
Привет! Поток событий возобновляется с курсора без пропусков и дубликатов.
こんにちは。ストリームはカーソルから再開されます。
你好，世界。每个租户只能看到自己的运行。
Ζήτω! Η χρέωση γίνεται ακριβώς μία φορά.
Emoji and symbols: ✅ ❌ → ← ≤ ≥ ± × ÷ € £ ¥ © ® ™ … — – • 🙂 🚀
"""


def _docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) > 40:
                found.append(doc)
    return found


def _stdlib_sources() -> list[Path]:
    paths = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in {"antigravity", "this"}:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        origin = Path(spec.origin)
        if origin.name == "__init__.py":
            paths.extend(sorted(p for p in origin.parent.rglob("*.py") if "test" not in p.parts))
        else:
            paths.append(origin)
    return paths


def build_corpus() -> str:
    parts = []
    seeds = sorted((SHARED_DIR / "seeds").glob("*.txt"))
    shared = [SHARED_DIR / "DESIGN.md", SHARED_DIR / "STYLE.md", *seeds]
    for path in shared:
        parts.append(path.read_text(encoding="utf-8"))
    parts.append(MULTILINGUAL)
    used = 0
    seen: set[str] = set()
    for path in _stdlib_sources():
        try:
            docs = _docstrings(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for doc in docs:
            if doc in seen:
                continue
            seen.add(doc)
            parts.append(doc)
            used += len(doc)
        if used >= STDLIB_BUDGET_CHARS:
            break
    return "\n\n".join(parts) + "\n"


def train(corpus: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(s)) == s exactly (no invented leading space).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.split("\n\n"), trainer=trainer)
    return tokenizer


ROUND_TRIP_SAMPLES = (
    "Hello, world! Sluice streams tokens by run id and cursor.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "def f(x):\n    return x ** 2  # comment",
    "Crème brûlée, naïve café — 東京 🚀 Привет",
    "",
)


def check(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    for text in ROUND_TRIP_SAMPLES:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text, (text, tokenizer.decode(ids))
        assert END_ID not in ids and PAD_ID not in ids


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "build"
    if command == "corpus":
        CORPUS_PATH.write_text(build_corpus(), encoding="utf-8")
        print(f"wrote {CORPUS_PATH} ({CORPUS_PATH.stat().st_size} bytes)")
        return 0
    if command == "build":
        tokenizer = train(CORPUS_PATH.read_text(encoding="utf-8"))
        check(tokenizer)
        TOKENIZER_PATH.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(TOKENIZER_PATH), pretty=False)
        digest = hashlib.sha256(TOKENIZER_PATH.read_bytes()).hexdigest()[:16]
        print(f"wrote {TOKENIZER_PATH} (vocab {VOCAB_SIZE}, sha256 {digest}…)")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
