"""Build a HF `tokenizers.Tokenizer` from the vocabulary a GGUF file carries in its metadata.

A GGUF has no tokenizer.json. It stores the pieces (`tokenizer.ggml.tokens`), their kinds
(`token_type`), and either BPE merges (`tokenizer.ggml.model == "gpt2"`, byte-level BPE) or
SentencePiece scores (`"llama"`, BPE over UTF-8 characters with byte fallback). The regex that splits
text before byte-level BPE is not stored; `tokenizer.ggml.pre` names it, and `_SPLITS` maps the
names we know to llama.cpp's regexes.

Token kinds (llama.cpp `llama_token_type`): 1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte. Control tokens become special added tokens and user-defined ones plain added
tokens, so both are matched whole in the text instead of being cut into pieces.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from colibri.core.errors import UnsupportedModelError

CONTROL, USER_DEFINED = 3, 4

# GPT-2's split; also the fallback for "default" and unknown `tokenizer.ggml.pre` values.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3 (tiktoken cl100k style): case-insensitive contractions, numbers in groups of up to 3.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: as Llama 3, but every digit is its own piece.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o / Llama 4 (o200k style): splits on case changes inside words.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SPLITS = {
    "default": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    # SmolLM's vocabulary has no multi-digit pieces; its original tokenizer splits digits first.
    "smollm": _GPT2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
}
_SPLIT_DIGITS_FIRST = {"smollm"}

# SentencePiece vocabularies whose scores do not follow merge order: rank by file position instead.
_RANK_BY_POSITION = {"gemma", "gemma2", "gemma3", "gemma3_text"}

# Texts llama.cpp treats as end-of-generation when they are control tokens.
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "<|end_of_text|>", "<|return|>", "<|call|>",
}


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer described by GGUF metadata `meta` (key -> decoded Python value).

    `tokenizer.encode(text)` adds BOS/EOS as `special_tokens(meta)` says; pass
    `add_special_tokens=False` to get the bare pieces.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tok, vocab = _byte_level(meta, tokens)
    elif kind == "llama":
        tok, vocab = _sentencepiece(meta, tokens)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )

    byte_alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    # A byte-level vocabulary spells every real piece in the byte alphabet; a "control" token outside
    # it is a mislabel, and adding it would grow the vocabulary past what the model was trained on.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == CONTROL and (byte_alphabet is None or set(t) <= byte_alphabet)
    ]
    tok.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types)
        if ty == USER_DEFINED and t in vocab
    ]
    tok.add_tokens(user)

    sp = special_tokens(meta)
    bos = sp["bos_token"] if sp["add_bos_token"] and sp["bos_token"] is not None else None
    eos = sp["eos_token"] if sp["add_eos_token"] and sp["eos_token"] is not None else None

    def template(seq: str, type_id: int) -> list[str]:
        out = [f"{seq}:{type_id}"]
        return [f"{bos}:{type_id}"] * (bos is not None) + out + [f"{eos}:{type_id}"] * (eos is not None)

    ids = [(bos, sp["bos_token_id"])] * (bos is not None) + [(eos, sp["eos_token_id"][0])] * (eos is not None)
    tok.post_processor = processors.TemplateProcessing(
        single=template("$A", 0), pair=template("$A", 0) + template("$B", 1), special_tokens=ids
    )
    return tok


def special_tokens(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Special ids and strings: bos/eos/unk/pad, whether encode adds BOS/EOS, end-of-generation ids.

    `eos_token_id` is a list: the file's EOS first, then its EOT/EOM ids and any control token that
    llama.cpp would also stop on (`<|im_end|>`, `<end_of_turn>`, ...).
    """
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []

    def tid(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}")
        return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

    bos, eos, unk, pad = tid("bos_token_id"), tid("eos_token_id"), tid("unknown_token_id"), tid("padding_token_id")
    eog = [i for i in (eos, tid("eot_token_id"), tid("eom_token_id")) if i is not None]
    eog += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in _EOG_TEXTS]
    kind = meta.get("tokenizer.ggml.model")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    return {
        "bos_token_id": bos,
        "eos_token_id": list(dict.fromkeys(eog)),
        "unk_token_id": unk,
        "pad_token_id": pad,
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "unk_token": tokens[unk] if unk is not None else None,
        "pad_token": tokens[pad] if pad is not None else None,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves,
    the other 68 to code points 256.. in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    # A piece outside the byte alphabet (rare, mislabelled specials) is respelled from its UTF-8 bytes.
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    pre = meta.get("tokenizer.ggml.pre", "default")
    split = _SPLITS.get(pre)
    if split is None:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; splitting text the GPT-2 way", stacklevel=3)
        split = _GPT2_SPLIT
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated")]
    if pre in _SPLIT_DIGITS_FIRST:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    """SentencePiece BPE as a HF BPE model: pieces spell spaces as U+2581, unknown bytes fall back
    to `<0xNN>` pieces, and the merge list is rebuilt from the vocabulary (the file has none)."""
    arch = meta.get("general.architecture")
    by_position = arch in _RANK_BY_POSITION
    if by_position:
        # Gemma stores its all-space pieces with real spaces; text is matched as U+2581.
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        rank = dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else "<unk>"
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=_merges_from_vocab(vocab, rank), unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if by_position:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok, vocab


def _merges_from_vocab(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces that are both in the vocabulary, best merged piece
    first (highest `rank`); splits of the same piece with the longer left part first."""
    found = []
    for piece, score in rank.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((score, len(lr[0]), len(lr[1]), lr) for lr in splits)
    # Stable sort, descending: ties keep vocabulary order.
    found.sort(key=lambda x: x[:3], reverse=True)
    return [lr for *_, lr in found]
