"""One process of tests/test_sharded.py: a model sharded across 2 CPU processes with PyTorch FSDP2.

Launched as ``python -m torch.distributed.run --nproc_per_node 2 tests/_sharded_worker.py MODE MODEL_DIR OUT_DIR``.
The DeviceManager starts the gloo process group (no GPU: CPU processes), and each check runs the real
code against ``fully_shard``-ed modules, whose forwards gather weights from the other process. MODE
``parts`` checks the functions one by one; ``trainers`` trains SFT, a reward model, DPO, GRPO (the model is the sharded
root) and PPO (the policy sits inside the sharded actor-critic) with a checkpoint, a resume and the final
model, sharded the way accelerate's FSDP2 ``prepare`` does it: in place, returning the module. Each process writes
``OUT_DIR/rank{N}.json`` with what it saw; the test asserts on them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import inference_optimizations as io  # noqa: E402
import rlhf  # noqa: E402


def shard(model: torch.nn.Module, body: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 as accelerate applies it: each decoder layer its own unit, then the root."""
    for layer in body.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def parts(model_dir: str, out_dir: str) -> None:
    devices = rlhf.DeviceManager()
    rank, out = devices.process_index, Path(out_dir)
    report: dict = {"rank": rank, "processes": devices.num_processes}
    torch.manual_seed(0)
    policy = rlhf.PolicyModel.from_pretrained(model_dir)
    policy.model.eval()
    original = weights(policy.model)
    formatter = rlhf.ChatFormatter(policy.tokenizer, "auto")
    records = rlhf.load_records("demo_eval", REPO / "data/demo", "prompt", max_samples=5)
    prompts = [formatter.prompt_ids(r) for r in records]

    # 1. the engine on a sharded model: each process its own prompts, the first process stopping early
    mine = prompts[:2] if rank == 0 else prompts[2:3]
    unsharded = {}
    for engine in ("static", "eager"):
        free = io.generate(policy.model, mine, io.SamplingParams(max_new_tokens=12, do_sample=False), pad_token_id=0,
                           engine=engine)
        stops = tuple(row[2] for row in free.token_ids) if rank == 0 else ()
        params = io.SamplingParams(max_new_tokens=12, do_sample=False, stop_token_ids=stops)
        unsharded[engine] = (params, io.generate(policy.model, mine, params, pad_token_id=0, engine=engine).token_ids)
    exact_unsharded = rlhf.evaluate_exact_match(policy, formatter, records, max_new_tokens=8, batch_size=2)

    shard(policy.model, policy.model.model)
    report["sharding"] = rlhf.weight_sharding(policy.model)
    devices.check_sharding(policy.model)  # FSDP2 is accepted
    report["generate"] = {}
    for engine, (params, expected) in unsharded.items():
        got = io.generate(policy.model, mine, params, pad_token_id=0, engine=engine, synced=True)
        report["generate"][engine] = {"equal": got.token_ids == expected, "lengths": [len(t) for t in got.token_ids]}
    # auto / compiled run the static path when synced (no collective inside a compiled graph)
    got = io.generate(policy.model, mine, unsharded["static"][0], pad_token_id=0, engine="compiled", synced=True)
    report["generate"]["compiled"] = {"equal": got.token_ids == unsharded["static"][1]}

    # 2. exact-match evaluation split across processes: 5 prompts, batch 2 -> 2 batches on one process, 1 on the
    #    other, so the shorter share is topped up to keep the forwards in lockstep
    report["exact_match"] = {
        "unsharded": exact_unsharded,
        "sharded": rlhf.evaluate_exact_match(policy, formatter, records, max_new_tokens=8, batch_size=2,
                                             devices=devices, synced=True)}

    # 3. a training step after generation (the engine ran under no_grad, not inference_mode)
    policy.model.train()
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    batch = torch.tensor([prompts[0]])
    loss = policy.model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    report["trained_loss"] = float(loss.detach())

    # 4. the whole weights gathered onto the main process, saved in Hugging Face layout and reloaded
    gathered = devices.full_state_dict(policy.model)
    report["gathered_on_this_process"] = gathered is not None
    if gathered is not None:
        saved = out / "policy"
        rlhf.PolicyModel(policy.model, policy.tokenizer).save_pretrained(saved, state_dict=gathered)
        reloaded = rlhf.PolicyModel.from_pretrained(str(saved))
        report["reloaded_vs_gathered"] = max_difference(weights(reloaded.model), {
            k: v for k, v in gathered.items() if k in reloaded.model.state_dict()})
        report["trained_vs_original"] = max_difference(gathered, original)
    # 5. whole weights loaded back into the shards (what a resume does): the original weights again
    devices.load_full_state_dict(policy.model, original)
    back = devices.full_state_dict(policy.model)
    if back is not None:
        report["restored_vs_original"] = max_difference(back, original)

    # 6. a reward model: backbone and head gathered, saved in its layout, scores as before
    reward = rlhf.RewardModel.from_pretrained(model_dir, seed=0)
    reward.model.eval()
    ids = torch.tensor([prompts[0], prompts[1][:len(prompts[0])]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected_scores = reward(ids, mask)
    shard(reward.model, reward.model.backbone.model)
    state = devices.full_state_dict(reward.model)
    if state is not None:
        reward.save_pretrained(out / "reward", state_dict=state)
        reloaded = rlhf.RewardModel.from_pretrained(str(out / "reward"))
        with torch.no_grad():
            report["reward_scores"] = [expected_scores.tolist(), reloaded(ids, mask).tolist()]

    # 7. FSDP v1 is refused with the fix in the message
    legacy = FullyShardedDataParallel(rlhf.PolicyModel.from_pretrained(model_dir).model, device_id=torch.device("cpu"),
                                      use_orig_params=True)
    try:
        devices.check_sharding(legacy)
        report["fsdp1_refused"] = ""
    except rlhf.RLHFInputError as error:
        report["fsdp1_refused"] = str(error)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    devices.wait()


class _ShardedResume:
    """Records the checkpoint a resume loaded and the weights it left in the shards."""

    def _load_checkpoint(self, path: Path) -> None:
        super()._load_checkpoint(path)
        self.resumed_from = (path.name, self.devices.full_state_dict(self.model))


class _ShardedPolicy(_ShardedResume):
    """The policy sharded with FSDP2, as ``accelerate.prepare`` does under fsdp_version 2 on GPUs (accelerate
    shards only there), so that the trainer's own generation, evaluation, checkpoint and resume code runs
    against a sharded model on CPU processes."""

    def _setup_model(self) -> None:
        self.policy.prepare_for_training(self.config)
        rlhf.disable_dropout(self.policy.model)
        self.model = shard(self.policy.model, rlhf.decoder_of(self.policy.model))
        self._setup_sharding()
        self.model.train()
        self.train_policy = self._prepared_view()


class ShardedSFTTrainer(_ShardedPolicy, rlhf.SFTTrainer):
    pass


class ShardedDPOTrainer(_ShardedPolicy, rlhf.DPOTrainer):
    pass


class ShardedGRPOTrainer(_ShardedPolicy, rlhf.GRPOTrainer):
    pass


class ShardedRewardModelTrainer(_ShardedResume, rlhf.RewardModelTrainer):
    """The reward model (backbone + head) sharded as one root, its decoder layers as units."""

    def _setup_model(self) -> None:
        self.policy.prepare_for_training(self.config)
        self.model = shard(self.policy.model, self.policy.model.backbone.model)
        self._setup_sharding()
        self.model.train()
        self.train_policy = self._prepared_view()


class ShardedPPOTrainer(_ShardedResume, rlhf.PPOTrainer):
    """PPO with the actor-critic sharded with FSDP2: the policy's embeddings and LM head and the value head
    belong to the root's shard, which generation through the policy alone does not gather by itself."""

    def _setup_model(self) -> None:
        self.policy.prepare_for_training(self.config)
        self.critic.head.requires_grad_(True)
        rlhf.disable_dropout(self.policy.model)
        self.actor_critic = rlhf.ActorCritic(self.policy.model, self.critic)
        self.model = shard(self.actor_critic, self.policy.model.model)
        self._setup_sharding()
        self.model.train()


class _Accelerated(_ShardedResume):
    """A trainer as accelerate prepares it under the launch's own configuration (``accelerate launch --use_deepspeed
    --zero_stage 3``, or DDP), with dropout off, so that two launch configurations train alike."""

    def _setup_model(self) -> None:
        rlhf.disable_dropout(self.policy.model)
        super()._setup_model()


class AcceleratedSFTTrainer(_Accelerated, rlhf.SFTTrainer):
    pass


class AcceleratedDPOTrainer(_Accelerated, rlhf.DPOTrainer):
    pass


class AcceleratedGRPOTrainer(_Accelerated, rlhf.GRPOTrainer):
    pass


class AcceleratedRewardModelTrainer(_ShardedResume, rlhf.RewardModelTrainer):
    pass


class AcceleratedPPOTrainer(_Accelerated, rlhf.PPOTrainer):
    pass


TRAINER_CLASSES = {  # layout -> sft, rm, dpo, grpo, ppo
    "fsdp2": (ShardedSFTTrainer, ShardedRewardModelTrainer, ShardedDPOTrainer, ShardedGRPOTrainer, ShardedPPOTrainer),
    "accelerate": (AcceleratedSFTTrainer, AcceleratedRewardModelTrainer, AcceleratedDPOTrainer,
                   AcceleratedGRPOTrainer, AcceleratedPPOTrainer)}


def completion_length(prompts: list[str], completions: list[str], answers: list) -> torch.Tensor:
    """A reward that varies within every group of the untrained model (format_reward is 0 for all of them, so
    GRPO's advantages, and its updates, would all be 0)."""
    return torch.tensor([float(len(c)) for c in completions])


def train_twice(name: str, trainer_class: type, config_class: type, settings: dict, dataset, devices,
                formatter, eval_records, model_dir: str, out: Path, **kwargs) -> dict:
    """2 steps with a checkpoint at step 2, then a second run resuming from it to step 4; then 4 steps without
    an interruption, whose weights the resumed run must end with."""
    report: dict = {}
    final = None  # the resumed run's weights, gathered on the main process
    for max_steps, resume, directory in ((2, "none", name), (4, "auto", name), (4, "none", f"{name}_straight")):
        rlhf.set_seed(0)
        config = config_class(**settings, output_dir=str(out / directory), max_steps=max_steps,
                              resume_from_checkpoint=resume)
        if name == "rm":
            trainer = trainer_class(config, rlhf.RewardModel.from_pretrained(model_dir), dataset, devices=devices,
                                    **kwargs)
        else:
            policy = rlhf.PolicyModel.from_pretrained(model_dir)
            extra = {"reference": rlhf.create_reference_model(config, policy)} if name in ("ppo", "dpo") else {}
            trainer = trainer_class(config, policy, dataset, formatter=formatter, devices=devices,
                                    eval_records=eval_records, **extra, **kwargs)
        result = trainer.train()
        if directory != name:  # the uninterrupted run: the resumed one restored the optimizer's moments too
            straight = devices.full_state_dict(trainer.model)
            if straight is not None and final is not None:
                report["resumed_vs_uninterrupted"] = max_difference(final, straight)
            break
        report.setdefault("sharded", []).append(trainer.sharded)
        report.setdefault("steps", []).append([row["step"] for row in result.history if "loss" in row])
        report.setdefault("losses", []).append([row["loss"] for row in result.history if "loss" in row])
        report.setdefault("grad_norms", []).append([row["grad_norm"] for row in result.history if "loss" in row])
        report.setdefault("eval", []).append(result.eval)
        report.setdefault("eval_before", []).append(result.eval_before)
        resumed = getattr(trainer, "resumed_from", None)
        report.setdefault("resumed_from", []).append(resumed[0] if resumed else None)
        checkpoint = out / name / "checkpoints/checkpoint-2"
        if resumed and resumed[1] is not None:  # the weights loaded back into the shards are checkpoint-2's
            report["resumed_vs_checkpoint"] = max_difference(
                resumed[1], load_file(str(checkpoint / rlhf.BaseTrainer.SHARDED_WEIGHTS_FILE)))
        if max_steps == 2 and checkpoint.exists():
            report["checkpoint_files"] = sorted(p.name for p in checkpoint.iterdir())
        final = devices.full_state_dict(trainer.model)
    if final is not None and name == "sft_lora":  # the adapter written from the gathered weights holds the trained ones
        saved = load_file(str(out / name / "adapter_model.safetensors"))
        # PEFT drops the adapter name
        trained = {k.replace(".default.", "."): v for k, v in final.items() if "lora_" in k}
        report["adapter_tensors"] = [len(saved), len(trained)]
        report["saved_vs_trained"] = max_difference(saved, trained)
    elif final is not None:  # the main process: the final model in Hugging Face layout holds the trained weights
        prefix = {"ppo": "policy.", "rm": "backbone."}.get(name, "")
        saved = rlhf.PolicyModel.from_pretrained(str(out / name)).model.state_dict()
        report["saved_vs_trained"] = max_difference(saved, {k[len(prefix):]: v for k, v in final.items()
                                                            if k.startswith(prefix) and k[len(prefix):] in saved})
        if name in ("ppo", "rm"):  # the value head beside the policy, the reward head beside the backbone
            file, prefix = ((rlhf.ValueModel.HEAD_FILE, "critic.head.") if name == "ppo"
                            else (rlhf.RewardModel.HEAD_FILE, "head."))
            report["head_vs_trained"] = max_difference(load_file(str(out / name / file)), {
                k[len(prefix):]: v for k, v in final.items() if k.startswith(prefix)})
    return report


def trainers(model_dir: str, out_dir: str, layout: str = "fsdp2") -> None:
    """``layout`` fsdp2: sharded by hand as accelerate's FSDP2 does it on GPUs; accelerate: prepared by accelerate
    as launched (DeepSpeed ZeRO-3 runs on CPU processes, over gloo)."""
    sft_class, rm_class, dpo_class, grpo_class, ppo_class = TRAINER_CLASSES[layout]
    devices = rlhf.DeviceManager()
    rank, out = devices.process_index, Path(out_dir)
    policy = rlhf.PolicyModel.from_pretrained(model_dir)
    formatter = rlhf.ChatFormatter(policy.tokenizer, "auto")
    records = rlhf.load_records("demo_rl", REPO / "data/demo", "prompt", max_samples=16)
    dataset = rlhf.GRPODataset(records, policy.tokenizer, formatter, cutoff_len=64)
    sft = rlhf.SFTDataset(rlhf.load_records("demo_sft", REPO / "data/demo", "sft", max_samples=32), policy.tokenizer,
                          formatter, cutoff_len=64)
    pairs = rlhf.PreferenceDataset(rlhf.load_records("demo_preference", REPO / "data/demo", "preference",
                                                     max_samples=32), policy.tokenizer, formatter, cutoff_len=64)
    eval_records = rlhf.load_records("demo_eval", REPO / "data/demo", "prompt", max_samples=3)  # shares of 2 and 1
    common = dict(model_name_or_path=model_dir, finetuning_type="full", max_completion_length=12, cutoff_len=64,
                  learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_steps=2,
                  disable_progress_bar=True, report_to="none", reward_funcs=["format"], seed=0,
                  eval_before_training=True, eval_max_new_tokens=8, per_device_eval_batch_size=1)
    offline = {k: v for k, v in common.items() if k not in ("max_completion_length", "reward_funcs")}
    # SFT and DPO also evaluate held-out loss / preference metrics in lockstep (eval_dataset: 5 items, batch 1)
    report = {"rank": rank,
              "sft": train_twice("sft", sft_class, rlhf.SFTConfig, dict(offline, per_device_train_batch_size=4),
                                 sft, devices, formatter, eval_records, model_dir, out,
                                 eval_dataset=torch.utils.data.Subset(sft, range(5))),
              "sft_lora": train_twice("sft_lora", sft_class, rlhf.SFTConfig,
                                      dict(offline, per_device_train_batch_size=4, finetuning_type="lora",
                                           lora_target="all", learning_rate=1e-2),
                                      sft, devices, formatter, eval_records, model_dir, out,
                                      eval_dataset=torch.utils.data.Subset(sft, range(5))),
              "rm": train_twice("rm", rm_class, rlhf.RewardModelConfig,
                                dict(offline, per_device_train_batch_size=4), pairs, devices, formatter, eval_records,
                                model_dir, out, eval_dataset=torch.utils.data.Subset(pairs, range(5))),
              "dpo": train_twice("dpo", dpo_class, rlhf.DPOConfig, dict(offline, per_device_train_batch_size=4),
                                 pairs, devices, formatter, eval_records, model_dir, out,
                                 eval_dataset=torch.utils.data.Subset(pairs, range(5))),
              "grpo": train_twice("grpo", grpo_class, rlhf.GRPOConfig,
                                  dict(common, num_generations=4, per_device_train_batch_size=8, beta=0.0),
                                  dataset, devices, formatter, eval_records, model_dir, out,
                                  reward_fn=completion_length),
              "ppo": train_twice("ppo", ppo_class, rlhf.PPOConfig,
                                 dict(common, per_device_train_batch_size=4, ppo_epochs=2),
                                 dataset, devices, formatter, eval_records, model_dir, out,
                                 reward_fn=rlhf.format_reward)}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, default=str))
    devices.wait()


class DigitShare:
    """Share of digit characters in a completion: varies within the tiny model's groups, so updates are not 0."""

    __name__ = "digit_share"

    def __call__(self, prompts, completions, answers):
        return torch.tensor([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions])


class _KeepsEngine:
    """Leaves the rollout engine open after training, so the test can sync it once more and ask it."""

    def close_rollouts(self) -> None:
        if getattr(self, "closing", False):
            super().close_rollouts()


class PlainGRPOTrainer(_KeepsEngine, rlhf.GRPOTrainer):
    """One process, or several without sharding, with dropout off as the sharded trainer has it."""

    def _setup_model(self) -> None:
        rlhf.disable_dropout(self.policy.model)
        super()._setup_model()


class ShardedVLLMGRPOTrainer(_KeepsEngine, ShardedGRPOTrainer):
    pass


def vllm(model_dir: str, out_dir: str, mode: str, port: str, sharded: str = "1", accumulation: str = "1",
         transfer: str = "files") -> None:
    """GRPO sampling with vLLM (``mode``: server, ``rlhf.py vllm-serve`` on ``port``; or colocate, an engine in each
    process), the policy FSDP2-sharded across the processes (``sharded`` 1) or whole on each: 2 optimizer steps,
    then the weights of step 2 synced through the trainer's own sync, and the engine's greedy answers compared
    with Hugging Face generate on the gathered weights; then a LoRA run (sharded, server)."""
    devices = rlhf.DeviceManager()
    rank, out = devices.process_index, Path(out_dir)
    policy = rlhf.PolicyModel.from_pretrained(model_dir)
    formatter = rlhf.ChatFormatter(policy.tokenizer, "auto")
    records = rlhf.load_records("demo_rl", REPO / "data/demo", "prompt", max_samples=32)
    dataset = rlhf.GRPODataset(records, policy.tokenizer, formatter, cutoff_len=64)
    common = dict(model_name_or_path=model_dir, finetuning_type="full", max_completion_length=8, cutoff_len=64,
                  num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=int(accumulation),
                  beta=0.0, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_steps=0,
                  disable_progress_bar=True, report_to="none", seed=0, resume_from_checkpoint="none",
                  use_vllm=True, vllm_mode=mode, vllm_server_port=int(port), reward_funcs=["format"],
                  vllm_weight_transfer=transfer)
    # sharded "1": FSDP2 by hand; "zero3": DeepSpeed ZeRO-3 as ``accelerate launch --use_deepspeed`` prepares it
    trainer_class = ShardedVLLMGRPOTrainer if sharded == "1" else PlainGRPOTrainer
    report: dict = {"rank": rank, "processes": devices.num_processes}
    rlhf.set_seed(0)
    config = rlhf.GRPOConfig(**common, output_dir=str(out / "full"), max_steps=2,
                             vllm_sync_dir=str(out / f"sync-full-{rank}"))
    trainer = trainer_class(config, policy, dataset, formatter=formatter, devices=devices, reward_fn=DigitShare())
    result = trainer.train()
    report["sharded"] = trainer.sharded
    report["rows"] = [{k: v for k, v in row.items() if k.startswith(("loss", "reward", "grad_norm", "vllm/", "perf/"))}
                      for row in result.history if "loss" in row]
    trainer.engine.at(trainer.global_step)  # the weights of step 2 (every process gathers alongside)
    meter = trainer.engine.weights.meter
    report["sync_peak_bytes"] = meter.peak if meter else None
    gathered = (devices.full_state_dict(trainer.model) if trainer.sharded
                else {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()})
    stops = tuple(formatter.stop_token_ids)
    prompts = [formatter.prompt_ids(r) for r in records[:4]]
    params = io.SamplingParams(max_new_tokens=12, do_sample=False, stop_token_ids=stops)
    if devices.is_main_process or mode == "colocate":
        report["engine_greedy"] = trainer.engine.engine.generate(prompts, params).token_ids
    if devices.is_main_process:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        save_file({k: v.contiguous() for k, v in gathered.items()}, str(out / "trained.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(gathered, strict=False)
        model.eval()
        hf = []
        for ids in prompts:
            tokens = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist()
            cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
            hf.append(tokens[:cut])
        report["hf_greedy"] = hf
        report["trained_vs_start"] = max(float((v.float() - start[k].float()).abs().max())
                                         for k, v in gathered.items() if k in start)
        sizes = {k: v.numel() * v.element_size() for k, v in gathered.items()}
        layers: dict[str, int] = {}
        for k, size in sizes.items():
            layer = k.split(".layers.")[1].split(".")[0] if ".layers." in k else k
            layers[layer] = layers.get(layer, 0) + size
        report["largest_tensor_bytes"] = max(sizes.values())
        report["largest_layer_bytes"] = max(layers.values())
        report["model_bytes"] = sum(sizes.values())
        if mode == "server" and transfer == "files":
            report["files_per_sync"] = len(list((out / f"sync-full-{rank}" / "weights").glob("*.safetensors")))
    trainer.closing = True
    trainer.close_rollouts()
    if sharded in ("1", "zero3") and mode == "server" and transfer == "files":  # LoRA: the base, then adapters
        rlhf.set_seed(0)
        config = rlhf.GRPOConfig(**dict(common, finetuning_type="lora", lora_rank=8, lora_target="all",
                                        learning_rate=1e-2), output_dir=str(out / "lora"), max_steps=2,
                                 vllm_sync_dir=str(out / f"sync-lora-{rank}"))
        lora_class = ShardedGRPOTrainer if sharded == "1" else rlhf.GRPOTrainer
        lora = lora_class(config, rlhf.PolicyModel.from_pretrained(model_dir), dataset, formatter=formatter,
                                  devices=devices, reward_fn=DigitShare())
        rows = [row for row in lora.train().history if "loss" in row]
        report["lora_sharded"] = lora.sharded
        report["lora_logprob_gap"] = [row.get("vllm/logprob_abs_diff_max") for row in rows]
        if devices.is_main_process:
            sync = out / f"sync-lora-{rank}"
            report["lora_synced"] = {"weights": len(list((sync / "weights").glob("*.safetensors"))),
                                     "adapters": len(list(sync.glob("adapter-*")))}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, default=str))
    devices.wait()


if __name__ == "__main__":
    {"parts": parts, "trainers": trainers, "vllm": vllm}[sys.argv[1]](*sys.argv[2:])
