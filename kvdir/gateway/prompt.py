"""From an OpenAI request body to the prompt's token ids (tokenizer, chat template).

- `/v1/completions`: `prompt` as text (tokenized), token ids (used as they
  are), or a batch of either (routed by its first element: one request goes
  to one backend).
- `/v1/chat/completions`: `messages` rendered with the model's Jinja chat
  template (sandboxed, as the engines render it) and tokenized without adding
  special tokens (the template writes them). Without a configured template a
  chat request is routed without a prefix (`None`).

Only what routing needs is validated; the body is forwarded unchanged, so the
engine stays the judge of everything else.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvdir.core.config import ConfigError
from kvdir.gateway.config import ModelConfig
from kvdir.gateway.errors import bad_request

TOKEN_ID_MAX = (1 << 32) - 1


def _raise_exception(message: str) -> None:
    """`raise_exception` of HF chat templates: a template's own refusal of the messages."""
    raise TemplateError(message)


class ModelPrompts:
    """One model's tokenizer and chat template (loaded once; both are thread-safe to use)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.tokenizer: Tokenizer | None = None
        if cfg.tokenizer:
            try:
                self.tokenizer = Tokenizer.from_file(cfg.tokenizer)
            except Exception as e:  # the library raises a bare Exception on bad files
                raise ConfigError(
                    f"model {cfg.name!r}: cannot load tokenizer {cfg.tokenizer}: {e}"
                ) from e
        self._template = None
        if cfg.chat_template:
            try:
                source = Path(cfg.chat_template).read_text()
            except OSError as e:
                raise ConfigError(
                    f"model {cfg.name!r}: cannot read {cfg.chat_template}: {e.strerror}"
                ) from e
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            try:
                self._template = env.from_string(source)
            except TemplateError as e:
                raise ConfigError(f"model {cfg.name!r}: bad chat template: {e}") from e

    def completion_tokens(self, body: dict[str, Any]) -> Sequence[int]:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("'prompt' is required", "prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch: one request goes to one backend, route by the first
        if isinstance(prompt, str):
            return self.encode(prompt, self.cfg.add_special_tokens)
        if isinstance(prompt, list):
            return self.token_ids(prompt, "prompt")
        raise bad_request("'prompt' must be a string, token ids, or a list of either", "prompt")

    def chat_tokens(self, body: dict[str, Any]) -> Sequence[int] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a 'role'", "messages")
        if self._template is None:
            return None
        gen = body.get("add_generation_prompt", True)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        try:
            text = self._template.render(
                **kwargs,
                messages=[_flatten(m) for m in messages],
                add_generation_prompt=bool(gen),
                bos_token=self.cfg.bos_token,
                eos_token=self.cfg.eos_token,
                tools=body.get("tools"),
            )
        except TemplateError as e:
            raise bad_request(f"the chat template refused the messages: {e}", "messages") from e
        return self.encode(text, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool) -> Sequence[int]:
        if self.tokenizer is None:
            raise bad_request(
                f"model {self.cfg.name!r} has no tokenizer configured at the gateway: "
                "send the prompt as token ids",
                "prompt",
            )
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self._limit(ids, "prompt")

    def token_ids(self, v: Sequence[Any], param: str) -> Sequence[int]:
        """The ids as a uint32 array: one C pass that refuses floats, strings, negatives and
        ids past 2^32 (JSON true/false pass as 1/0: the engine judges those)."""
        try:
            ids = array("I", v)
        except (TypeError, OverflowError):
            raise bad_request(
                f"'{param}' token ids must be integers in 0..{TOKEN_ID_MAX}", param
            ) from None
        return self._limit(ids, param)

    def _limit(self, ids: Sequence[int], param: str) -> Sequence[int]:
        if len(ids) > self.cfg.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {len(ids)} tokens, more than max_prompt_tokens "
                f"({self.cfg.max_prompt_tokens})",
                param,
            )
        return ids


def _flatten(m: dict[str, Any]) -> dict[str, Any]:
    """Content given as parts (`[{"type": "text", "text": ...}]`) joined into one string."""
    content = m.get("content")
    if isinstance(content, list):
        texts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        return {**m, "content": "".join(t for t in texts if isinstance(t, str))}
    return m
