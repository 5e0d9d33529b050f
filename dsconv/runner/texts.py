"""Text files and tokenizers both calibration and evaluation read: one record's text, a .jsonl / .json set validated
line by line, a UTF-8 file under a size cap, and the model's own tokenizer (never remote code).

Accepted records: a string, or an object carrying the text under `inputs_pretokenized`, `text`, `prompt`, `question`
(+ optional `answer`), or `messages` (a chat, rendered with the tokenizer's chat template when it has one). A
malformed line is a UserError naming the file and the line; an empty set is an error.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dsconv import schemas
from dsconv.errors import UserError

TEXT_KEYS = ("inputs_pretokenized", "text", "prompt")


def _render_messages(messages: Any, tokenizer: Any, where: str) -> str:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in messages):
        raise UserError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects",
                        hint="write each turn as {\"role\": \"user\", \"content\": \"...\"}")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # a template error is about this line's content or the tokenizer
            raise UserError(f"{where}: the tokenizer's chat template failed on this chat ({type(e).__name__}: {e})",
                            hint="check the roles and content of the messages") from None
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def text_of(row: Any, where: str, tokenizer: Any = None) -> str:
    """The calibration text one record stands for (a string, or an object with one of the known keys)."""
    if isinstance(row, str):
        text = row
    elif isinstance(row, dict):
        if "messages" in row:
            text = _render_messages(row["messages"], tokenizer, where)
        elif "question" in row:
            q, a = row["question"], row.get("answer", "")
            if not isinstance(q, str) or not isinstance(a, str):
                raise UserError(f"{where}: \"question\" and \"answer\" must be strings")
            text = f"{q}\n{a}" if a else q
        else:
            key = next((k for k in TEXT_KEYS if k in row), None)
            if key is None:
                raise UserError(f"{where}: no calibration text (keys: {', '.join(sorted(row)) or 'none'})",
                                hint="use one of inputs_pretokenized, text, prompt, question (+answer), messages")
            text = row[key]
            if not isinstance(text, str):
                raise UserError(f"{where}: \"{key}\" must be a string, got {type(text).__name__}")
    else:
        raise UserError(f"{where}: expected a string or an object, got {type(row).__name__}",
                        hint="one JSON object per line, e.g. {\"text\": \"...\"}")
    if not text.strip():
        raise UserError(f"{where}: empty calibration text", hint="remove the line or give it text")
    return text


MAX_CALIB_FILE = 2**30  # a calibration set is prompts (10-1000), not a corpus


def read_utf8(path: Path, what: str, hint: str) -> str:
    """A text file's content, or a one-line error saying it is missing or not UTF-8."""
    return schemas.decode_utf8(schemas.read_bytes(Path(path), what, hint, limit=MAX_CALIB_FILE), str(path))


def read_texts(path: Path, tokenizer: Any = None) -> list[str]:
    """Every calibration text of a .jsonl / .json file, in file order; errors name the file and the line."""
    path = Path(path)
    raw = read_utf8(path, "calibration file", "pass a .jsonl or .json file with --calib")
    texts = [text_of(row, where, tokenizer) for where, row in schemas.calibration_rows(path, raw)]
    if not texts:
        raise UserError(f"{path}: the calibration set is empty", hint="give at least a few prompts (10-100)")
    return texts


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def require_tokenizer_files(model_dir: Path) -> None:
    """UserError when the directory holds none of a tokenizer's files (checked before any work)."""
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)})",
                        hint="copy the model's tokenizer into the directory: calibration and evaluation need it")


def load_tokenizer(model_dir: Path):
    """The model's own tokenizer (calibration tokens must be the ones the model was trained on)."""
    require_tokenizer_files(model_dir)
    try:
        from transformers import AutoTokenizer

        # never remote code: Kimi-K2's config.json names some in auto_map (transformers would ask to run it)
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as e:  # transformers raises OSError/ValueError/... for a missing or broken tokenizer
        remote = _remote_tokenizer(Path(model_dir))
        if remote:  # Kimi-K2 ships a tiktoken tokenizer as code (tokenization_kimi.py)
            raise UserError(f"{model_dir}: its tokenizer is remote code ({remote}), which dsconv never runs",
                            hint="save a tokenizer.json for it once (e.g. transformers' TikTokenConverter over its "
                                 "tiktoken.model) and drop auto_map from tokenizer_config.json in a copy") from None
        raise UserError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__})",
                        hint="calibration needs the model's tokenizer files (tokenizer.json / tokenizer_config.json)"
                        ) from None


def _remote_tokenizer(model_dir: Path) -> str | None:
    """The auto_map entry naming a tokenizer class in code, where tokenizer_config.json has one."""
    import json

    try:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    auto = cfg.get("auto_map") if isinstance(cfg, dict) else None
    entry = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    return f"tokenizer_config.json auto_map AutoTokenizer: {entry}" if entry else None
