"""Opt-in evidence capture: degenerate attempts as size-bounded, rotated JSONL.

Each record holds what an upstream bug report needs: time, model, backend, the
backend's vLLM version, detector kind, prompt and cached token counts, a
fingerprint of the prompt, and the degenerate output (truncated). The prompt
text itself only when ``evidence.include_prompt`` allows it. Nothing is written
unless ``evidence.enabled`` is set.

With several workers each process writes its own file (``PATH.<pid>``), so no two
processes append to one file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.config import EvidenceSettings


@dataclass(frozen=True, slots=True)
class EvidenceRecord:
    model: str | None
    backend: str
    vllm_version: str | None
    kind: str
    endpoint: str
    stream: bool
    attempt: int
    prompt_tokens: int | None
    cached_tokens: int | None
    prompt_fingerprint: str
    output: str
    prompt: Any = None
    #: The request's ``x-request-id``: its log lines carry the same.
    request_id: str | None = None


def prompt_fingerprint(body: dict[str, Any]) -> str:
    lead = body.get("messages", body.get("prompt"))
    try:
        encoded = orjson.dumps(lead, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # nested past orjson's limit: not a prompt worth telling apart
        encoded = b"\x00unencodable"
    return hashlib.sha256(encoded).hexdigest()[:32]


class EvidenceStore:
    def __init__(self, settings: EvidenceSettings, *, per_process: bool = False) -> None:
        self.settings = settings
        path = Path(settings.path)
        self.path = path.with_name(f"{path.name}.{os.getpid()}") if per_process else path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path.parent, os.W_OK):  # a read-only mount says so here
            raise PermissionError(errno.EROFS, "not writable", str(self.path.parent))

    def write(self, record: EvidenceRecord) -> None:
        data = {
            "time": time.time(),
            **{k: getattr(record, k) for k in record.__slots__ if k != "prompt"},
            "output": record.output[: self.settings.max_output_chars],
        }
        if self.settings.include_prompt:
            data["prompt"] = record.prompt
        try:
            line = orjson.dumps(data) + b"\n"
        except TypeError:  # a prompt nested past orjson's limit: keep the rest
            data["prompt"] = "(not stored: nested too deeply to encode)"
            line = orjson.dumps(data) + b"\n"
        self._rotate_if_needed(len(line))
        with self.path.open("ab") as handle:
            handle.write(line)

    def _rotate_if_needed(self, incoming: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size + incoming <= self.settings.max_bytes:
            return
        backups = self.settings.backups
        if backups == 0:
            self.path.unlink()
            return
        for index in range(backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))


def read_records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        with path.open("rb") as handle:
            for line in handle:
                if line.strip():
                    yield orjson.loads(line)


def evidence_files(path: Path) -> list[Path]:
    """The store and its rotated and per-process siblings."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file())
    return sorted(p for p in path.parent.glob(path.name + "*") if p.is_file())


def summarise(records: Iterable[dict[str, Any]]) -> str:
    rows = list(records)
    if not rows:
        return "no evidence records"
    kinds = Counter(r["kind"] for r in rows)
    where = Counter((r.get("model"), r["backend"], r.get("vllm_version")) for r in rows)
    cached = [r for r in rows if isinstance(r.get("cached_tokens"), int)]
    hits = sum(1 for r in cached if r["cached_tokens"] > 0)
    first = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(min(r["time"] for r in rows)))
    last = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(max(r["time"] for r in rows)))
    lines = [f"{len(rows)} degenerate attempts, {first} .. {last} UTC", "", "by kind:"]
    lines += [f"  {kind:<22} {count}" for kind, count in kinds.most_common()]
    lines += ["", "by model / backend / vLLM version:"]
    lines += [f"  {m} / {b} / {v or 'unknown'}: {n}" for (m, b, v), n in where.most_common()]
    if cached:
        lines += [
            "",
            f"prefix-cache hit on {hits} of {len(cached)} attempts with token counts "
            f"({hits / len(cached):.0%}); mean cached tokens "
            f"{sum(r['cached_tokens'] for r in cached) / len(cached):.0f}",
        ]
    fingerprints = Counter(r["prompt_fingerprint"] for r in rows)
    repeated = sum(1 for n in fingerprints.values() if n > 1)
    lines.append(f"distinct prompts: {len(fingerprints)} ({repeated} seen more than once)")
    return "\n".join(lines)
