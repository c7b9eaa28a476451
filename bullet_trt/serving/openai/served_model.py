"""What the OpenAI front end knows of the model Triton serves: its name, tokenizer, limits and
chat template, read from the same engine directory the Triton model loads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from bullet_trt.config import load_engine_config
from bullet_trt.engine.validation import RequestLimits
from bullet_trt.model.chat_template import ChatTemplate, ChatTemplateError
from bullet_trt.model.tokenizer import Tokenizer
from bullet_trt.serving.openai.errors import OpenAIError, invalid


@dataclass
class ServedModel:
    name: str  # the Triton model's name, also the OpenAI model id
    tokenizer: Tokenizer
    limits: RequestLimits
    chat_template: ChatTemplate | None

    @classmethod
    def load(cls, engine_dir: str | Path, name: str = "bullet", overrides: dict[str, str] | None = None,
             chat_template_file: str | Path | None = None) -> "ServedModel":
        cfg = load_engine_config(engine_dir, overrides)
        tokenizer = Tokenizer(cfg.tokenizer_path)
        template = ChatTemplate.from_engine(engine_dir, chat_template_file)
        return cls(name, tokenizer, RequestLimits(cfg.max_model_len, vocab_size=tokenizer.vocab_size), template)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self.chat_template is None:
            raise OpenAIError(400, f"model {self.name!r} has no chat template (its checkpoint's tokenizer_config.json "
                                   "has no chat_template and there is no chat_template.jinja beside it): use "
                                   "/v1/completions, or start the server with --chat-template FILE",
                              param="messages", code="no_chat_template")
        try:
            text = self.chat_template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise invalid(str(e), param="messages") from None
        return self._without_added_bos(text)

    def _without_added_bos(self, text: str) -> str:
        # Templates write the BOS token into the text, and a tokenizer whose post-processor adds
        # BOS would add a second; models answer worse after two. Keep the tokenizer's one.
        bos = self.tokenizer.bos_token_id
        if bos is None:
            return text
        bos_text = self.tokenizer.decode([bos], skip_special_tokens=False)
        if bos_text and text.startswith(bos_text) and self.tokenizer.encode("a")[:1] == [bos]:
            return text[len(bos_text):]
        return text
