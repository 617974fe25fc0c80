"""Print how far each data-parallel layout is from the single-process reference (the figures the tests bound).

    python tests/parallel/parity_figures.py [--tp]

It lives with the tests it reads (their layouts, runs and reference), not in benchmarks/: no benchmark imports tests/.

For every layout of tests/parallel/test_parity.py and both tiny models: the largest per-step loss difference over 6
AdamW steps. Then, with -100 labels spread unevenly, the largest parameter difference after 6 SGD steps,
next to what naive averaging of per-rank means would give. With --tp: the tensor-parallel layouts of
tests/parallel/tensor/test_tensor_parallel.py instead, for every model, with and without Megatron-style sequence
parallelism.
"""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "scripts"), str(TESTS / "parallel"), str(TESTS / "parallel" / "tensor")]

import torch  # noqa: E402

torch.set_num_threads(1)  # forked ranks share the cores

import test_parity as tp  # noqa: E402


def tensor_parallel() -> None:
    import test_tensor_parallel as ttp

    print("max |loss - reference| over 6 steps")
    print("model    layout        TP        TP + sequence parallel")
    for model in ttp.MODELS:
        ref = tp.reference(model)
        for name, world, flags in ttp.TP_LAYOUTS:
            diffs = []
            for extra in ([], ["--sequence-parallel"]):
                results = tp.run_layout(model, world, flags, 1, *extra)
                diffs.append(max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"])))
            print(f"{model:8s} {name:13s} {diffs[0]:.2e}  {diffs[1]:.2e}")


def main() -> None:
    if "--tp" in sys.argv[1:]:
        return tensor_parallel()
    print("model   layout          max |loss - reference| over 6 steps")
    for model in ("llama", "qwen2"):
        ref = tp.reference(model)
        for name, world, flags, accum in tp.LAYOUTS:
            results = tp.run_layout(model, world, flags, accum)
            diff = max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"]))
            print(f"{model:7s} {name:15s} {diff:.2e}")
    sgd = dict(uneven_labels=True, optimizer="sgd", lr=0.5)
    ref = tp.reference("llama", **sgd)
    naive = tp.reference("llama", mean_of_chunks=2, **sgd)
    print("\nuneven -100 labels, max |param - reference| after 6 SGD steps")
    print(f"naive mean of 2 rank means  {tp.max_param_diff(naive['params'], ref['params']):.2e}")
    for name, world, flags, accum in (tp.LAYOUTS[1], tp.LAYOUTS[4], tp.LAYOUTS[5]):
        results = tp.run_layout("llama", world, flags, accum, "--uneven-labels", "--optimizer", "sgd", "--lr", "0.5",
                                "--return-params")
        print(f"ndparallel {name:16s} {tp.max_param_diff(results[0]['params'], ref['params']):.2e}")


if __name__ == "__main__":
    main()
