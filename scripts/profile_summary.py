"""Summarise py-spy's raw (collapsed-stack) profiles: per thread, its samples and the functions that take
the most of them, by own time (the leaf frame) and with everything they call (inclusive).

    python scripts/profile_summary.py out/server-profile/*-server.txt [--top 15]

A line of py-spy's raw format is ``frame;frame;...;leaf COUNT``; with ``--threads`` the first frame names
the thread. Idle samples are not recorded (py-spy's default), so a thread's samples over the run's are its
busy share.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def short(frame: str) -> str:
    """``func (path/to/module.py:123)`` -> ``func (module.py)``: lines merged, paths cut."""
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    return f"{m['func']} ({Path(m['file']).name})"


def load(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    threads: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, names = stack.split(";"), []
        while frames and frames[0].startswith(("process ", "thread ")):  # [process;][thread;]frames
            names.append(frames.pop(0))  # (--subprocesses: each process's threads apart)
        threads[" / ".join(names) or "main"].append(([short(f) for f in frames], int(count)))
    return threads


def summarise(path: Path, top: int) -> None:
    threads = load(path)
    total = sum(c for stacks in threads.values() for _, c in stacks)
    print(f"\n=== {path.name}: {total} samples")
    for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        n = sum(c for _, c in stacks)
        if n < 0.02 * total:
            continue
        own, inclusive = Counter(), Counter()
        for frames, c in stacks:
            if frames:
                own[frames[-1]] += c
            for f in set(frames):
                inclusive[f] += c
        print(f"--- {thread}: {n} samples ({100 * n / total:.0f}%)")
        print("  own time:")
        for f, c in own.most_common(top):
            print(f"    {100 * c / n:5.1f}%  {f}")
        print("  inclusive:")
        for f, c in inclusive.most_common(top):
            print(f"    {100 * c / n:5.1f}%  {f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    for path in args.profiles:
        if path.exists():
            summarise(path, args.top)


if __name__ == "__main__":
    main()
