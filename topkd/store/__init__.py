"""Offline distillation: the teacher's top-K rows stored on disk, read by sample id.

``safetensors`` is needed (``pip install topkd[store]``); building from a Hugging Face model
needs ``transformers`` too (``topkd[hf]``).
"""

from .build import build_store
from .data import TeacherDataset, collate, require_keys
from .format import token_hash
from .reader import MissingSampleError, TeacherStore, collate_teachers
from .serving import import_jsonl, teacher_from_logprobs
from .verify import verify_store
from .writer import TeacherStoreWriter


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable fingerprint of a Hugging Face tokenizer's vocabulary and special tokens: stores
    written and read with different tokenizers are refused by it."""
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    data = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()[:32]


__all__ = ["TeacherStore", "TeacherStoreWriter", "TeacherDataset", "MissingSampleError",
           "build_store", "collate", "collate_teachers", "import_jsonl", "require_keys",
           "teacher_from_logprobs", "token_hash", "tokenizer_fingerprint", "verify_store"]
