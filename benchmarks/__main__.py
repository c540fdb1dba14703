"""``python -m benchmarks [fused | store | compile | trainer | megatron] [options]``, from the
repository root: one section.

No section: the core losses against the plain float32 code (:mod:`benchmarks.core`);
``fused`` (or ``--fused``): the fused LM-head losses (:mod:`benchmarks.fused`); ``store``: the
offline teacher store (:mod:`benchmarks.store`); ``compile``: the compiled kernels' first-call
cost, cold and from inductor's on-disk cache (:mod:`benchmarks.compiling`); ``trainer``:
whole training runs of ``KDTrainer`` against TRL's ``GKDTrainer`` (:mod:`benchmarks.trainer`);
``megatron``: topkd's Model-Optimizer Megatron criteria against Model-Optimizer's own at TP
gloo ranks (:mod:`benchmarks.megatron`).
``--child SPEC``
is the harness's own child process (:func:`benchmarks.harness.run_child`).
"""

from __future__ import annotations

import sys

from . import compiling, core, fused, harness, megatron, store, trainer


def main(argv=None) -> int:
    rest = sys.argv[1:] if argv is None else list(argv)
    if rest[:1] == ["--child"]:
        return harness.child_main(rest[1])
    if rest[:1] in (["fused"], ["--fused"]):
        return fused.main(rest[1:])
    if rest[:1] == ["store"]:
        return store.main(rest[1:])
    if rest[:1] == ["compile"]:
        return compiling.main(rest[1:])
    if rest[:1] == ["trainer"]:
        return trainer.main(rest[1:])
    if rest[:1] == ["megatron"]:
        return megatron.main(rest[1:])
    return core.main(rest)


if __name__ == "__main__":
    sys.exit(main())
