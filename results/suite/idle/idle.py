"""Idle CPU per test module: tsplugin.py's phases log against a `vmstat -n 1` trace whose lines
are prefixed with the Unix time.

    python idle.py phases.log vmstat.log
"""

import collections
import sys

lines = [line.split() for line in open(sys.argv[1])]
vm = []
for line in open(sys.argv[2]):
    p = line.split()
    if len(p) > 16 and p[1].isdigit():
        vm.append((int(p[0]), int(p[15])))  # time, idle %


def idle(a: float, b: float) -> tuple[float, int]:
    xs = [i for (t, i) in vm if a <= t < b]
    return (sum(xs) / len(xs) if xs else float("nan")), len(xs)


def nodeid(p: list[str]) -> str:
    return " ".join(p[2:] if p[1] == "start" else p[4:])


spans: dict[str, list[float]] = collections.OrderedDict()
phase: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
idle_in = collections.defaultdict(lambda: [0.0, 0.0])
for p in lines:
    t, node = float(p[0]), nodeid(p)
    module = node.split("::")[0]
    span = spans.setdefault(module, [t, t])
    span[1] = max(span[1], t)
    if p[1] in ("setup", "call", "teardown"):
        d = float(p[3])
        phase[module][p[1]] += d
        i, n = idle(t - d, t)
        if n and d >= 1:
            idle_in[(module, p[1])][0] += d
            idle_in[(module, p[1])][1] += d * i / 100
first, last = min(s[0] for s in spans.values()), max(s[1] for s in spans.values())
print(f"whole run: {(last - first) / 60:.1f} min, idle {idle(first, last)[0]:.1f} %\n")
print("module | min | idle % | setup s | call s | teardown s | idle core-s")
for module, (a, b) in spans.items():
    if b - a >= 5:
        i, _ = idle(a, b)
        ph = phase[module]
        print(
            f"{module} | {(b - a) / 60:.2f} | {i:.1f} | {ph['setup']:.1f} | {ph['call']:.1f} | "
            f"{ph['teardown']:.1f} | {(b - a) * 2 * i / 100:.0f}"
        )
print("\nmodule, phase | seconds | idle %")
for (module, when), (d, idle_s) in idle_in.items():
    if d > 10:
        print(f"{module}, {when} | {d:.1f} | {100 * idle_s / d:.1f}")
