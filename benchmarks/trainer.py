"""The Hugging Face Trainer's step time through ndparallel against the same script under stock Accelerate.

    python benchmarks/trainer.py [--rounds 5] [--steps 30] [--warmup 5] [--hidden 256] [--layers 4] [--seq 128]
                                 [--batch 4] [--world 2]

Stock Accelerate runs on CPU only as plain data parallelism (DDP), so that is the layout compared: the same Trainer
job on `--world` forked gloo ranks (`run_ranks`), once as transformers builds it (stock Accelerate, DDP) and
once taken over by ndparallel (`ndparallel launch --dp-replicate-size N`'s environment: ndparallel's DDP). Runs
alternate, one of each per round; each run reports the median of its per-step times after `--warmup` steps (a
TrainerCallback stamps every optimizer step). Printed: each round's pair and ratio, then the median ratio over the
rounds and its spread (min..max). Target (issue 24): ndparallel / stock <= 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch  # noqa: E402

torch.set_num_threads(1)  # forked ranks share the cores

from common import llama  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402


def job(options: dict, ndparallel: bool) -> dict:
    """One Trainer run in this rank; the per-step wall times after warm-up."""
    if ndparallel:
        from ndparallel.launch.worker import attach_integrations

        attach_integrations()  # what ndparallel's launcher does in each rank when given sizes
    from transformers import Trainer, TrainerCallback, TrainingArguments

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003 -- the callback protocol
            stamps.append(time.perf_counter())

    hidden, seq = options["hidden"], options["seq"]
    model = llama(vocab=2048, hidden=hidden, layers=options["layers"], intermediate=4 * hidden, max_positions=seq)
    ids = torch.randint(0, 2048, (options["batch"] * options["world"] * (options["steps"] + 1), seq),
                        generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=options["steps"], learning_rate=1e-4,
                             per_device_train_batch_size=options["batch"], logging_steps=10_000, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Stamp()])
    trainer.train()
    steps = [b - a for a, b in zip(stamps, stamps[1:])][options["warmup"]:]
    return {"median": statistics.median(steps), "accelerator": type(trainer.accelerator).__module__}


def run(options: dict, ndparallel: bool) -> float:
    env = {"NDPARALLEL_DP_REPLICATE_SIZE": str(options["world"])} if ndparallel else {}
    results = run_ranks(job, options["world"], options, ndparallel, env=env, timeout=1800)
    expected = "ndparallel.integrations.trainer_accelerator" if ndparallel else "accelerate.accelerator"
    assert all(r["accelerator"] == expected for r in results), results
    return max(r["median"] for r in results)  # the step ends when the slowest rank's does


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("rounds", 5), ("steps", 30), ("warmup", 5), ("hidden", 256), ("layers", 4), ("seq", 128),
                          ("batch", 4), ("world", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    options = vars(p.parse_args(argv))
    print(f"Trainer, DDP over {options['world']} CPU ranks: Llama hidden {options['hidden']}, {options['layers']} "
          f"layers, sequence {options['seq']}, {options['batch']} rows per rank; median step of {options['steps']} "
          f"after {options['warmup']} warm-up")
    print("round  stock Accelerate (s)  ndparallel (s)  ndparallel / stock")
    ratios = []
    for round_ in range(options["rounds"]):
        order = (False, True) if round_ % 2 == 0 else (True, False)  # alternate which goes first
        times = {kind: run(options, kind) for kind in order}
        ratios.append(times[True] / times[False])
        print(f"{round_ + 1:5d}  {times[False]:20.4f}  {times[True]:14.4f}  {ratios[-1]:18.3f}")
    print(f"median ratio {statistics.median(ratios):.3f} (spread {min(ratios):.3f}..{max(ratios):.3f} over "
          f"{len(ratios)} rounds); target <= 1.05")


if __name__ == "__main__":
    main()
