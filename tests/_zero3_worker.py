"""One process of tests/test_sharded.py's ZeRO-3 test: the policy partitioned across 2 CPU processes by DeepSpeed.

Launched as ``python -m torch.distributed.run --nproc_per_node 2 tests/_zero3_worker.py MODEL_DIR OUT_DIR`` with
``DS_ACCELERATOR=cpu`` (DeepSpeed over gloo). The tiny policy (tied embeddings) is wrapped with ZeRO-3 and takes one
AdamW step, an unsharded copy the same step on the same batch; then ``rlhf.gathered_named_tensors`` reads the
partitioned weights back one module at a time, as the vLLM weight sync does. Each process writes
``OUT_DIR/rank{N}.json`` with what it saw; the test asserts on them.
"""

from __future__ import annotations

import copy
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rlhf  # noqa: E402

LR = 1e-3


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` with tied duplicates dropped (the first name kept), as the sync sends it."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[name] = tensor.detach().clone()
    return state


def module_bytes(model: torch.nn.Module) -> list[int]:
    """Each module's own parameters' bytes (tied ones counted once, with their first owner)."""
    seen: set[int] = set()
    sizes = []
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            sizes.append(sum(p.numel() * p.element_size() for p in params))
    return sizes


def same_on_all_ranks(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.flatten().float() for t in tensors])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], other) for other in every)


def read_all(model: torch.nn.Module, meter: rlhf.GatherMeter | None = None, wanted=None) -> dict:
    """Iterate the gather to its end the way the sync does (each tensor dropped before the next is gathered),
    keeping untracked copies for the comparisons."""
    names, layout, kept = [], [], {}
    for name, tensor in rlhf.gathered_named_tensors(model, "zero3", wanted=wanted, meter=meter):
        names.append(name)
        layout.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
        assert not tensor.requires_grad and not isinstance(tensor, torch.nn.Parameter), name
        kept[name] = tensor.clone()
        del tensor
    return {"names": names, "layout": layout, "tensors": kept}


def main(model_dir: str, out_dir: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))  # a hang fails fast
    rank, out = dist.get_rank(), Path(out_dir)
    report: dict = {"rank": rank, "processes": dist.get_world_size()}
    torch.manual_seed(0)
    policy = rlhf.PolicyModel.from_pretrained(model_dir)
    model = policy.model
    report["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    unsharded = copy.deepcopy(model)
    initial = unique_state(unsharded)
    expected_names = list(initial)
    sizes = module_bytes(unsharded)
    report["largest_module_bytes"], report["model_bytes"] = max(sizes), sum(sizes)

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0}  # DeepSpeed clips at 1.0 unless told
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)
    report["sharding"] = rlhf.weight_sharding(engine.module)
    report["partitioned"] = all(p.numel() == 0 for p in engine.module.parameters())

    # one step on both copies, the same batch on both processes (so the averaged gradient is the one-process one)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    optimizer = torch.optim.AdamW(unsharded.parameters(), lr=LR)
    reference_loss = unsharded(input_ids=ids, labels=ids).loss
    reference_loss.backward()
    optimizer.step()
    report["loss"] = [loss.item(), reference_loss.item()]
    trained = unique_state(unsharded)

    # 1. the whole model, one module at a time, metered
    meter = rlhf.GatherMeter()
    started = time.time()
    full = read_all(engine.module, meter)
    report["gather_seconds"] = time.time() - started
    report["names"], report["expected_names"] = full["names"], expected_names
    got = full["tensors"]
    report["max_diff"] = max(float((got[k] - trained[k]).abs().max()) for k in expected_names if k in got)
    report["trained_vs_initial"] = max(float((trained[k] - initial[k]).abs().max()) for k in expected_names)
    report["layout"] = [list(row) for row in rlhf.sharded_layout(engine.module, "zero3")]
    report["gathered_layout"] = full["layout"]
    report["meter"] = {"peak": meter.peak, "total": meter.total, "live_after": meter.live}
    report["identical_across_ranks"] = same_on_all_ranks([got[k] for k in full["names"]])
    report["partitioned_after"] = all(p.numel() == 0 for p in engine.module.parameters())
    del full, got

    # 2. a filter: the first decoder layer's weights only
    wanted = lambda name: "layers.0." in name  # noqa: E731
    some = read_all(engine.module, wanted=wanted)
    report["wanted_names"] = some["names"]
    report["wanted_expected"] = [k for k in expected_names if wanted(k)]
    report["wanted_layout"] = [list(row) for row in rlhf.sharded_layout(engine.module, "zero3", wanted)]
    report["wanted_max_diff"] = max(float((t - trained[k]).abs().max()) for k, t in some["tensors"].items())
    del some

    # 3. the first process stops after 3 tensors (a consumer's error) while the second reads to the end
    started = time.time()
    reader = rlhf.gathered_named_tensors(engine.module, "zero3")
    if rank == 0:
        taken = [next(reader)[0] for _ in range(3)]
        reader.close()  # gathers and drops the rest, pairing the second process's gathers
    else:
        taken = [name for name, _ in reader]
    report["early_close"] = {"taken": taken, "seconds": time.time() - started}
    again = read_all(engine.module)
    report["after_close"] = {"names_equal": again["names"] == expected_names,
                             "max_diff": max(float((t - trained[k]).abs().max()) for k, t in again["tensors"].items()),
                             "identical_across_ranks": same_on_all_ranks(list(again["tensors"].values()))}
    # and training still pairs up afterwards
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    report["trained_after"] = loss.item()

    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    del engine, model, policy  # DeepSpeed's hooks and groups go before the process group does
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()  # else the first process aborts on exit


if __name__ == "__main__":
    main(*sys.argv[1:])
