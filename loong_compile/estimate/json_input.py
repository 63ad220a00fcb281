"""Reading a JSON object the user names on the command line (a model config, a hardware
profile): every failure is a ``LoongConfigError`` naming the file."""

from __future__ import annotations

import json
from pathlib import Path

from loong_compile.errors import LoongConfigError


def read_json_object(path: Path, what: str, example: str) -> dict:
    """The JSON object in ``path``; ``what`` names the file's role ("model config"), ``example``
    says what a valid file is ("a Hugging Face config.json")."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoongConfigError(f"{what} {str(path)!r} does not exist", None,
                               f"pass the path of an existing file: {example}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise LoongConfigError(f"{what} {str(path)!r} is not readable JSON ({exc})", None,
                               f"fix the file: {example}") from None
    if not isinstance(data, dict):
        raise LoongConfigError(f"{what} {str(path)!r} holds {type(data).__name__}",
                               f"a {what} is a JSON object", f"pass {example}")
    return data
