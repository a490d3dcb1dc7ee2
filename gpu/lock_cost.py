"""What the weights lock costs a forward and a reload, uncontended (best of 5 x 20,000):
a read access on the main thread (where Ctrl-C is handled) and on another, and a reload's
write access (`commit_hold`, then `take`) on the main thread. CPU only: no device needed,
run on the GPU host to measure its CPU. Two trees compare in one run with PYTHONPATH:

    python3 gpu/lock_cost.py
    PYTHONPATH=/tmp/old_tree python3 gpu/lock_cost.py
"""

from __future__ import annotations

import threading
import time

import fp8_reload
from fp8_reload.locks import WeightsLock


def best_us(fn, n: int = 20_000, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    lock = WeightsLock()

    def read():
        with lock.read():
            pass

    def write():
        hold = lock.commit_hold()
        with hold:
            hold.take()

    out = {"read, main thread": best_us(read), "write, main thread": best_us(write)}
    other = threading.Thread(target=lambda: out.__setitem__("read, other thread", best_us(read)))
    other.start()
    other.join()
    print(f"[lock] {fp8_reload.__file__}: " + ", ".join(f"{k} {v:.1f} us" for k, v in out.items()))


if __name__ == "__main__":
    main()
