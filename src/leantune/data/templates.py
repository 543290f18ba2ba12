"""data.chat_template: a chat template for a tokenizer that has none (a base model), or another one.

The value is a built-in name or the path of a Jinja file; it replaces the tokenizer's template
before anything is tokenised.

The built-ins are the templates as their authors publish them:
- chatml: the ChatML template of the transformers chat-templating documentation (as Qwen2 and
  SmolLM2 use it); its turns end with `<|im_end|>`.
- zephyr: HuggingFaceH4/zephyr-7b-beta's; every turn ends with the tokenizer's own eos token, so
  it suits any tokenizer.
- llama3: meta-llama/Meta-Llama-3-8B-Instruct's; it needs Llama 3's special tokens and a bos token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantune.config import ConfigError


@dataclass(frozen=True)
class BuiltinTemplate:
    """A chat template leantune ships, and the special tokens it writes."""

    text: str
    tokens: tuple[str, ...] = ()
    """Tokens the template writes that should be single tokens of the tokenizer."""
    source: str = ""
    """Where the template is published."""


BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    "chatml": BuiltinTemplate(
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
        ("<|im_start|>", "<|im_end|>"),
        "transformers chat templating documentation (ChatML)",
    ),
    "zephyr": BuiltinTemplate(
        "{% for message in messages %}\n"
        "{% if message['role'] == 'user' %}\n"
        "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'system' %}\n"
        "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'assistant' %}\n"
        "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
        "{% endif %}\n"
        "{% if loop.last and add_generation_prompt %}\n"
        "{{ '<|assistant|>' }}\n"
        "{% endif %}\n"
        "{% endfor %}",
        (),
        "HuggingFaceH4/zephyr-7b-beta",
    ),
    "llama3": BuiltinTemplate(
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        "+ message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "meta-llama/Meta-Llama-3-8B-Instruct",
    ),
}


class ChatTemplateError(ConfigError):
    """data.chat_template names no built-in and no readable Jinja template file."""


def is_builtin(spec: str) -> bool:
    """True when `spec` is the name of a built-in template."""
    return spec in BUILTIN_TEMPLATES


def template_text(spec: str) -> str:
    """The Jinja text of a built-in name or a template file, checked to parse.

    Raises:
        ChatTemplateError: naming data.chat_template and the file (and line) when it is not one.
    """
    if is_builtin(spec):
        return BUILTIN_TEMPLATES[spec].text
    path = Path(spec).expanduser()
    # A bare word (no separator, no extension) that is no file is most likely a mistyped
    # built-in name: say so, rather than "no such file".
    names = ", ".join(BUILTIN_TEMPLATES)
    try:
        if not any(c in spec for c in "/\\.") and not path.exists():
            raise ChatTemplateError(
                f"data.chat_template: {spec!r} is neither a built-in template ({names}) nor a file"
            )
        if path.is_dir():
            raise ChatTemplateError(f"data.chat_template: {path}: a directory, not a Jinja file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ChatTemplateError(
            f"data.chat_template: {path}: no such file (built-in templates: {names})"
        ) from None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, a name the OS refuses
        if isinstance(e, ChatTemplateError):
            raise
        raise ChatTemplateError(f"data.chat_template: {spec!r}: cannot be read ({e})") from None
    _check_syntax(text, path)
    return text


def _check_syntax(text: str, path: Path) -> None:
    """Parse `text` as transformers does (its loop controls and `{% generation %}` included)."""
    import jinja2  # only when a template file is given

    try:
        # transformers' own compiler, so a template that parses here renders there too
        # (plain jinja2 does not know `{% generation %}`); a private name, hence the fallback.
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(text)
    except ImportError:  # another transformers layout: jinja's own parser, with loop controls
        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(_syntax_message(path, e)) from None
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(_syntax_message(path, e)) from None


def _syntax_message(path: Path, e: Any) -> str:
    return f"data.chat_template: {path}:{e.lineno}: not a valid Jinja template: {e.message}"


def apply_chat_template(tokenizer: Any, spec: str | None) -> list[str]:
    """Give `tokenizer` the template `spec` (None: keep its own); returns warnings to show.

    Raises:
        ChatTemplateError: `spec` is no built-in and no readable Jinja template file.
    """
    if spec is None:
        return []
    # Set before anything is tokenised: the tokenise-once cache (keyed by the tokenizer's
    # fingerprint, template included) and the saved tokenizer in `final/` both carry it, so
    # eval, generate and export render prompts the way the model was trained.
    tokenizer.chat_template = template_text(spec)
    builtin = BUILTIN_TEMPLATES.get(spec)
    warnings: list[str] = []
    # A warning, not an error: a built-in whose special tokens the tokenizer lacks still works,
    # but the model learns each as several pieces and generation stops only at the eos token.
    if builtin is not None and builtin.tokens:
        vocab = tokenizer.get_vocab()
        missing = [t for t in builtin.tokens if t not in vocab]
        if missing:
            warnings.append(
                f"data.chat_template={spec}: {', '.join(missing)} "
                f"{'is not a token' if len(missing) == 1 else 'are not tokens'} of this "
                "tokenizer: the model learns to write each as several pieces, and generation "
                "stops only at its eos token or the length limit; data.chat_template=zephyr ends "
                "every turn with the tokenizer's own eos token"
            )
    if spec == "llama3" and getattr(tokenizer, "bos_token", None) is None:
        warnings.append(
            "data.chat_template=llama3 opens with the bos token, and this tokenizer has none: "
            "every conversation will be refused"
        )
    return warnings
