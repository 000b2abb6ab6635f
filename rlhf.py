"""rlhf — post-training for causal language models, in one module.

Supervised fine-tuning, reward and process-reward modelling, preference optimisation (DPO family,
SimPO, ORPO, KTO) and online RL (GRPO and its variants, RLOO, REINFORCE++, online DPO, on-policy distillation,
PPO), for text and vision-language models; evaluation, export and merging build on the same sections. Runs on a laptop
CPU with the embedded ``tiny`` (and ``tiny-vl``) model and the bundled demo tasks, and on GPUs through accelerate.

    python rlhf.py pipeline --config configs/demo.yaml
    python rlhf.py sft --config configs/sft.yaml learning_rate=1e-4

Table of contents: every public name, by section (each opens with a ``# ==== N. Title ====`` banner); "add:"
says what a contributor adds there, and docs/architecture.md walks through each:
  0. Notation and registries
       IGNORE_INDEX, RLHFInputError, TrainingInterrupted, TrainingPreempted, POLICY_LOSS_AGGREGATIONS, PolicyLoss,
       POLICY_LOSSES, register_policy_loss, policy_loss, Stage, STAGES, register_stage, EPISODE_SOURCES,
       register_episode_source, ROLLOUT_SCHEDULERS, register_rollout_scheduler
       add: a constant or error type every section shares, a registry whose entries live in later sections
  1. Configs
       BaseConfig, OnlineRLConfig, parse_overrides, read_yaml, build_config, load_config, save_config, config_help,
       PipelineConfig, get_7b_model_config, get_70b_model_config, count_parameters, model_architecture,
       count_lora_parameters, estimate_memory
       add: a field every stage shares (BaseConfig) or every sampling stage shares (OnlineRLConfig), a pipeline key, a
            LLaMA-Factory or TRL key in LLAMAFACTORY_RENAMES / TRL_OPENRLHF_RENAMES (a stage's own config lives in its
            section 10 slice)
  2. Infrastructure
       rich_console, setup_logging, logging_restored, write_text_atomic, stale_model_files, set_seed, parameter_numel,
       weight_sharding, GatherMeter, gathered_named_tensors, sharded_layout, DeepSpeedSupport, DeviceManager, smoothed,
       plot_metrics, PlainProgress, ModelShape, gpu_peak_flops, measured_cpu_peak_flops, device_peak_flops,
       TrainingLogger, optimizer_state_to_safetensors, optimizer_state_from_safetensors, capture_rng_state,
       restore_rng_state, RunFolderLock, releases_output_dir, CheckpointManager, PreemptionGuard, CheckpointingMixin,
       create_optimizer, EarlyStopping, find_linear_module_names, find_expert_parameter_names, apply_freeze,
       compile_model, compile_training_step
       add: a logging target (REPORT_TARGETS), something a checkpoint carries (CheckpointManager), an optimizer
  3. Data
       DatasetSpec, resolve_dataset, iter_raw_records, parse_record, count_placeholders, open_image, to_record,
       load_records, extract_answer, ChatTemplate, TEMPLATES, register_template, CHAT_TEMPLATES,
       TEMPLATE_SPECIAL_TOKENS, ChatFormatter, saved_as_trained, truncate_example, pack_sequences, SFTDataset,
       StreamingRecordDataset, StreamingSFTDataset, SFTCollator, split_budget, truncate_prompt_and_responses,
       PreferenceDataset, KTODataset, StreamingPreferenceDataset, StreamingKTODataset, GRPODataset, DistillDataset,
       StreamingGRPODataset, pack_rows, pack_preference_pairs, PreferenceBatch, PreferenceCollator, KTOBatch,
       KTOCollator, split_steps, arithmetic_step_labels, arithmetic_response_labels, encode_steps,
       ProcessPreferenceDataset, ProcessPreferenceCollator, group_by_length, ResumableBatchSampler
       add: a dataset format (parse_record), a chat template (one register_template(ChatTemplate(...))), a dataset class
  4. Model loading and the output head
       token_log_probs, token_entropy, OutputHead, head_logits, head_reduction, LogProbs, load_tokenizer,
       build_tiny_model, EMBEDDED_MODELS, resolve_model_path, gguf_metadata, gguf_to_hf, quantization_config,
       is_quantized, load_causal_lm
       add: a model family's loading quirk, a model file format (GGUF's conversion is the example), an embedded model
            (EMBEDDED_MODELS)
  5. Vision-language models
       text_config, is_vision_language, vision_kwargs, fit_pixels, VisionInputs, load_vision_inputs,
       set_trainable_parts, lora_target_names, build_tiny_vl_model
       add: a vision-language family's image tokens and pixel inputs (VisionInputs), its trainable parts
  6. Policy, reward and value models
       PolicyModel, chat_formatter, state_under, load_weights_into, decoder_of, last_token_index, scalar_head,
       RewardScorer, RewardModel, RewardEnsemble, aggregate_step_scores, ProcessRewardModel, ValueModel, ActorCritic,
       select_informative_tokens, ContextCompressor, ReferenceModel, can_pack_pairs, tree_attention_mask,
       shared_prefix_log_probs, grouped_packed_logits, grouped_logits, grouped_prefix_logits, create_reference_model,
       disable_dropout, apply_lora
       add: a model wrapper or head (with save_pretrained / from_pretrained), a way to run the policy's forward
  7. Losses and advantages
       router_load_balancing_loss, causal_lm_loss_sum, causal_lm_loss_with, sequence_log_probs, PREFERENCE_LOSSES,
       dpo_loss, simpo_loss, orpo_loss, kto_loss, reward_model_loss, reward_boosting_weights, ewc_penalty,
       ElasticWeightConsolidation, whiten, grpo_advantages, rloo_advantages, overlong_penalty, reinforce_pp_advantages,
       generalized_jsd_loss, rollout_importance_weights, PolicyLossInputs, token_log_ratio, sequence_log_ratio,
       IMPORTANCE_LOG_RATIOS, LossAggregation, LOSS_AGGREGATIONS, clipped_surrogate_loss, cispo_loss, grpo_loss,
       compute_gae, ppo_policy_loss, ppo_value_loss, AdaptiveKLController, FixedKLController
       add: a loss or advantage estimator as a pure function citing its paper and equation; a DPO variant is a
            PREFERENCE_LOSSES row, an RL policy loss a @register_policy_loss function of PolicyLossInputs
  8. Rewards
       exact_answer_reward, format_reward, length_penalty, no_reward, CompositeReward, LearnedReward, ProcessReward,
       post_json, RewardAPIError, HTTPReward, Principle, ConstitutionalRewardWrapper, RewardFunctionFactory,
       RunningRewardNormalizer, process_rewards, Environment, ToolCall, parse_tool_call, calculate, ToolEnvironment,
       CalculatorEnvironment, EnvironmentFault, HTTPEnvironment, AgentCall, AgentEndpoint, openai_answer,
       concatenated_trajectory, CallTimedOut, call_with_timeout, retried, guarded_call, RolloutHung, RolloutWatchdog,
       failed_groups, environment_factory
       add: a rule reward (RewardFunctionFactory.RULES, or module:function from your own file), an environment
            (Environment subclass, environment_factory)
  9. Rollouts
       Rollout, Episodes, completion_metrics, episode_metrics, RolloutStopped, PromptBatch, PromptStream,
       with_lookahead, rollout_seed, turn_seed, buffer_order_seed, rollout_sampling_params, PolicyWeightSource,
       EngineContext, ROLLOUT_ENGINES, register_rollout_engine, rollout_engine_name, server_run_identity,
       MeasuredEngineChoice, engine_label, SyncedEngine, EpisodeSource, implied_episode_source, episode_source_name,
       SingleTurnSource, ToolEnvironmentSource, AgentRollout, AgentProgramSource, RolloutScheduler,
       rollout_scheduler_name, SyncScheduler, BoundedStalenessScheduler, InFlightScheduler, token_version_metrics,
       Scores, RolloutScorer, rollout_rows, per_call_rows, engine_log_probs, engine_correction, rollout_file,
       save_rollouts, episodes_to_json, episodes_from_json, buffer_file, save_buffers, load_buffer, RolloutLedger,
       load_rollout
       add: an episode source (a class with EpisodeSource's members, @register_episode_source), a rollout scheduler
            (RolloutScheduler's members, @register_rollout_scheduler), a rollout engine (a class with
            inference_optimizations.RolloutEngine's members and a @register_rollout_engine builder of an EngineContext)
  10. Trainers
       close_loss_scaler_step, TrainingDivergedError, TrainResult, RouterAuxLoss, BaseTrainer, evaluate_exact_match,
       read_stage_records, check_model_paths, SFTConfig, SFTTrainer, read_sft_records, build_sft_data, train_sft,
       RewardModelConfig, PairScores, RewardModelTrainer, train_rm, ProcessRewardModelConfig, ProcessRewardModelTrainer,
       train_prm, PolicyLogProbs, precompute_ref_log_probs, reference_cache_fingerprint, reference_cache_tensors,
       read_reference_cache, DPOConfig, SimPOConfig, ORPOConfig, DPOTrainer, SimPOTrainer, train_dpo, KTOConfig,
       KTOTrainer, train_kto, GRPOConfig, RLOOConfig, ReinforcePPConfig, GRPOTrainer, train_grpo, OnlineDPOConfig,
       OnlineDPOTrainer, train_online_dpo, DistillConfig, DistillTrainer, check_same_vocabulary, train_distill,
       PPOConfig, RolloutBuffer, PPOTrainer, train_ppo, TrainingStage
       add: a stage, as one slice: a reading map, its config (a dataclass on BaseConfig or OnlineRLConfig, every field
            _opt(default, help)), its trainer (BaseTrainer, or _OnlineRLTrainer when it samples), a train_<stage>
            runner, and register_stage(Stage(...)) after it (docs/development.md shows one)
  11. Evaluation
       kl_estimates, distinct_n, self_similarity, win_rate, RLHFEvaluator
       add: a metric of RLHFEvaluator
  12. Self-improvement and safety
       CapabilityReport, CapabilityTester, repetition_rate, degeneration_rates, reward_hacking_flags,
       perturb_whitespace, perturb_case, perturb_prefix, PERTURBATIONS, answer_consistency, validation_score,
       ValidationReport, AdversarialValidator, default_critique, RefinementResult, refinement_pairs,
       write_preference_jsonl, IterativeRefiner
       add: a capability check, a perturbation (PERTURBATIONS), a reward-hacking rule (REWARD_HACKING_RULES)
  13. Orchestrator
       read_report, append_report, summary_table, data_fingerprint, pipeline_rows, pipeline_table,
       write_pipeline_report, StageNotRun, FinalStages, RLHFOrchestrator
       add: a pipeline step after training (FINAL_STAGES and FINAL_STAGE_OPTIONS, a FinalStages method), a
            summary-table column
  14. Export, evaluation and chat
       ExportConfig, load_merged_policy, export_model, GGUFArchitecture, GGUF_EXPORT_ARCHITECTURES,
       gguf_hyperparameters, permute_for_gguf, gguf_vocabulary, write_gguf, EvalConfig, evaluate_model, eval_table,
       ChatConfig, ChatSession, chat
       add: an export format (EXPORT_FORMATS), a GGUF architecture (GGUF_EXPORT_ARCHITECTURES)
  15. CLI
       memory_plan_table, main
       add: a command (main's dispatch and its --help)

Notation used in ``Shapes:`` lines: B sequences in a batch, T tokens per sequence, V vocabulary size.
docs/architecture.md is the map of these sections: the data path from a YAML key to the loss, and where to add
a stage, a loss, an engine, a template, a reward or an environment.
"""

from __future__ import annotations

import argparse
import array
import ast
import bisect
import collections
import concurrent.futures
import contextlib
import copy
import csv
import dataclasses
import difflib
import enum
import functools
import gc
import hashlib
import http.client
import importlib.util
import inspect
import io
import itertools
import json
import logging
import math
import operator
import os
import random
import re
import secrets
import shutil
import signal
import sys
import threading
import time
import types
import typing
import urllib.error
import urllib.request
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from inference_optimizations import (
    END_MARKERS,
    HTTP_IDLE_SECONDS,
    QUANTIZED_ROLLOUT_DTYPES,
    VLLM_MODES,
    WEIGHT_TRANSFERS,
    BestOfNSampler,
    BoundedJSONServer,
    GatheredRead,
    GenerationOutput,
    HTTPRefusal,
    LocalEngine,
    PolicyWeights,
    QuantizedEngine,
    RolloutEngine,
    SamplingParams,
    VLLMClient,
    VLLMEngine,
    VLLMServerError,
    VLLMServerPool,
    _filter_logits,
    answer_agreement,
    cache_argument,
    encode_at_boundaries,
    innermost_model,
    is_loopback,
    pin_cpu_kernels,
    require_bearer,
    returned_cache,
    run_folder,
    save_weight_shards,
    select_attention_implementation,
    stop_token_ids,
    use_persistent_compile_cache,
    vllm_engine_for,
    vllm_missing,
    vllm_serve,
)
from inference_optimizations import (
    generate as generate_tokens,
)

__version__ = "0.1.0"
logger = logging.getLogger("rlhf")

# ==== 0. Notation and registries ====

IGNORE_INDEX = -100  # label value that cross-entropy skips (prompt and padding tokens)
REPO_DIR = Path(__file__).resolve().parent
DEMO_DATA_DIR = REPO_DIR / "data" / "demo"
# module-name pieces of a vision-language model's language model (matched as substrings): section 1's memory plan
# counts the parameters outside them, section 5 freezes them, section 6 encodes images once when nothing else trains
LANGUAGE_MODEL_KEYS = ("language_model", "lm_head")


def _checkout_path(relative: str) -> Path:
    """A path of the source checkout (the demo data, configs/): beside this module when it runs from the checkout,
    else under the working directory, since ``pip install .`` installs the modules only and its users run the
    ``rlhf`` command from the checkout."""
    beside = REPO_DIR / relative
    return beside if beside.exists() else Path.cwd() / relative


class RLHFInputError(ValueError):
    """A user mistake (config value, data record, missing file). The CLI prints it as one line,
    without a traceback; the message names the field or file:line and says how to fix it."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, carrying what to run next for this config (resume, or how to keep the checkpoints
    a config that starts over would delete). A KeyboardInterrupt still, so every handler of one sees it."""


class TrainingPreempted(TrainingInterrupted):
    """A scheduler's stop signal (SIGTERM, or SIGUSR1 that SLURM sends ahead of a job's end) during training: the
    current optimizer step finished and a checkpoint was written; ``exit_code`` is the shell's 128 + signal."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signal_number


def _one_line(err: BaseException) -> str:
    """An error as one line of a user-facing message: its type and its first line (160 characters at most)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160]}" if text else type(err).__name__


# An RL policy loss (the grpo stage's ``loss_type``; rloo and reinforce_pp use it too) is one registered function
# of section 7's PolicyLossInputs, returning each token's loss (B, T), and an aggregation that says how the tokens
# reduce to the step's loss; section 7's LOSS_AGGREGATIONS implements these, for the loss and the trainer alike.
POLICY_LOSS_AGGREGATIONS = (
    "sequence_mean",           # each sequence's token mean, then the mean over sequences (GRPO)
    "micro_batch_token_mean",  # the token mean of each micro-batch, averaged over micro-batches (BNPO)
    "step_token_mean",         # the token mean over the whole optimizer step (DAPO)
    "fixed_length_sum",        # the sum over tokens / (B * max_completion_length) (Dr. GRPO)
)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered RL policy loss: ``per_token(inputs: PolicyLossInputs) -> (B, T)`` losses before the KL term
    and rollout importance weights, reduced by ``aggregation`` (POLICY_LOSS_AGGREGATIONS). ``token_level_only``
    refuses GSPO's sequence-level ratio (importance_sampling_level sequence)."""

    name: str
    per_token: Callable[..., torch.Tensor]
    aggregation: str
    token_level_only: bool = False


POLICY_LOSSES: dict[str, PolicyLoss] = {}  # section 7 registers grpo, bnpo, dapo, dr_grpo and cispo


def register_policy_loss(name: str, *, aggregation: str, token_level_only: bool = False) -> Callable:
    """Decorator: register ``fn(inputs) -> per-token loss`` as the policy loss ``name`` (SkyRL's
    ``@register_policy_loss``). A user's module registers its own and the config names it as
    ``loss_type: mypkg.losses:my_loss``: the module is imported, which registers the loss."""
    if aggregation not in POLICY_LOSS_AGGREGATIONS:
        raise ValueError(f"policy loss {name!r}: aggregation {aggregation!r}; valid: "
                         f"{', '.join(POLICY_LOSS_AGGREGATIONS)}")

    def register(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        POLICY_LOSSES[name] = PolicyLoss(name, fn, aggregation, token_level_only)
        return fn

    return register


def policy_loss(name: str) -> PolicyLoss:
    """The policy loss a config's ``loss_type`` names: a registered name, or ``module:function`` whose module
    registers it when imported (under the function's name or ``module:function``)."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    if ":" not in str(name):
        hint = difflib.get_close_matches(str(name), POLICY_LOSSES, n=1)
        suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise RLHFInputError(f"config field 'loss_type' is '{name}'{suggestion}; valid: {', '.join(POLICY_LOSSES)}, "
                             f"or module:function registered with rlhf.register_policy_loss")

    module_name, _, attribute = name.partition(":")
    try:
        importlib.import_module(module_name)
    except ImportError as error:
        raise RLHFInputError(f"config field 'loss_type': cannot import {module_name!r} ({error}); put the module "
                             f"on PYTHONPATH") from None
    found = [loss for loss in POLICY_LOSSES.values()
             if loss.name in (name, attribute) or (getattr(loss.per_token, "__module__", None) == module_name
                                                   and getattr(loss.per_token, "__name__", None) == attribute)]
    if not found:
        raise RLHFInputError(f"config field 'loss_type': importing {module_name} registered no policy loss named "
                             f"{attribute!r}; decorate it with @rlhf.register_policy_loss({attribute!r}, "
                             f"aggregation=...)")
    return found[0]


# A stage is one slice of section 10: a reading map, its config, trainer and runner, and one register_stage(Stage(...))
# after the runner. Every list of stages the pipeline reads is a view of STAGES, so adding a stage is that slice.
@dataclass(frozen=True)
class Stage:
    """A registered training stage.

    Args:
        name: its name in configs, on the command line and in reports (``stage: dpo``); ``config.stage``.
        config: its config dataclass (a BaseConfig subclass).
        runner: ``runner(config) -> TrainResult``, which trains it (``train_<stage>``).
        trainer: the trainer class the runner builds.
        record_kind: the record format its dataset is read as (load_records: sft, preference, kto or prompt).
        makes_policy: its output is a policy the next pipeline stage starts from (a reward model's is a scorer).
        optimises_policy: it improves a policy it starts from: capability gates, EWC and merges apply to it."""

    name: str
    config: type
    runner: Callable[..., Any]
    trainer: type
    record_kind: str
    makes_policy: bool = True
    optimises_policy: bool = True


STAGES: dict[str, Stage] = {}  # name -> Stage, in registration order (pipeline order)


def register_stage(stage: Stage) -> Stage:
    """Add a stage to STAGES (and so to every view below). Its config's ``stage`` must be its name."""
    if getattr(stage.config, "stage", None) != stage.name:
        raise ValueError(f"stage {stage.name!r}: {stage.config.__name__}.stage is "
                         f"{getattr(stage.config, 'stage', None)!r}")
    STAGES[stage.name] = stage
    return stage


class _RegistryColumn(Mapping):
    """A read-only view of one field of a registry's records (STAGES, TEMPLATES) by name, in registration order."""

    def __init__(self, registry: dict[str, Any], field_name: str) -> None:
        self.registry, self.field_name = registry, field_name

    def __getitem__(self, name: str) -> Any:
        return getattr(self.registry[name], self.field_name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry)

    def __len__(self) -> int:
        return len(self.registry)

    def __repr__(self) -> str:
        return repr(dict(self))


class _StagesWhere(Sequence):
    """A read-only view of the names of the stages with a true flag, in registration order."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, stage in STAGES.items() if getattr(stage, self.flag))

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in STAGES and bool(getattr(STAGES[name], self.flag))

    def __repr__(self) -> str:
        return repr(self._names())


STAGE_CONFIGS: Mapping[str, type[BaseConfig]] = _RegistryColumn(STAGES, "config")
STAGE_RUNNERS: Mapping[str, Callable[[BaseConfig], TrainResult]] = _RegistryColumn(STAGES, "runner")
STAGE_RECORD_KINDS: Mapping[str, str] = _RegistryColumn(STAGES, "record_kind")
POLICY_STAGES: Sequence[str] = _StagesWhere("makes_policy")  # the next stage starts from their output
POLICY_OPTIMISATION_STAGES: Sequence[str] = _StagesWhere("optimises_policy")  # gates, EWC and merges apply


# Rollouts (section 9): what one sample of a prompt is (an episode source) and when rollouts are sampled (a rollout
# scheduler), each a class registered by name; the config values episode_source and rollout_scheduler pick them.
EPISODE_SOURCES: dict[str, type] = {}  # section 9 registers single_turn, tool_environment and agent_program
ROLLOUT_SCHEDULERS: dict[str, type] = {}  # section 9 registers sync, bounded_staleness and in_flight


def register_episode_source(name: str) -> Callable[[type], type]:
    """Class decorator: ``cls(config, policy, formatter)``, an EpisodeSource (section 9), becomes the episode source
    ``name``, which ``episode_source: name`` picks."""
    def register(cls: type) -> type:
        EPISODE_SOURCES[name] = cls
        return cls
    return register


def register_rollout_scheduler(name: str) -> Callable[[type], type]:
    """Class decorator: ``cls(config, source, engine, params_for, steps_per_rollout)``, a RolloutScheduler (section
    9), becomes the rollout scheduler ``name``, which ``rollout_scheduler: name`` picks."""
    def register(cls: type) -> type:
        ROLLOUT_SCHEDULERS[name] = cls
        return cls
    return register


class _StageName(str, enum.Enum):
    """Base of TrainingStage (section 10 builds it from STAGES): a str that prints as the plain stage name."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def _default_cache_dir() -> Path:
    """Where the embedded model and tokenised datasets are cached (``RLHF_CACHE`` overrides)."""
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf"))


# ==== 1. Configs ====


def _opt(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field whose one-line help feeds ``--help`` and docs/configuration.md."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
              "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay")
# reduce_lr_on_plateau is left out: it steps on a metric, and the trainers step schedules per optimizer step.
ATTENTION_CHOICES = ("auto", "flash_attention_2", "sdpa", "eager")
REPORT_TARGETS = ("tensorboard", "wandb")
FINETUNING_TYPES = ("full", "lora", "oft", "freeze")
# Section 5's PREFERENCE_LOSSES implements exactly these (a test keeps the two in step).
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "kto_pair", "robust", "bco_pair", "exo_pair", "nca_pair", "sppo_hard",
                  "apo_zero", "apo_down")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo")  # the policy losses section 7 registers (POLICY_LOSSES)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # sequence: GSPO
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")  # critic-free; PPO's is GAE
ADVANTAGE_ESTIMATOR_ALIASES = {"group_norm": "grpo", "reinforce": "reinforce_pp",  # OpenRLHF's names
                               "reinforce_baseline": "reinforce_pp_baseline",
                               "reinforce_plus_plus": "reinforce_pp",  # verl's
                               "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}
TOOL_FORMATS = ("tag", "chat_template")  # how environments' tool calls are written (section 8)
REWARD_SCALES = ("group", "batch", "none")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # section 7
VLLM_OLD_LOGPROBS = ("trainer", "engine")
ROLLOUT_DTYPES = ("auto", *QUANTIZED_ROLLOUT_DTYPES)  # what our engine samples from: the policy, or a QuantizedEngine
PRM_AGGREGATIONS = ("min", "product", "last")  # how a process reward model combines its step scores
ENSEMBLE_STRATEGIES = ("seeds", "boosting")  # how the members of a reward-model ensemble come to differ
PREF_LOSSES = DPO_LOSS_TYPES + ("orpo", "simpo")  # LLaMA-Factory's pref_loss: the DPO family plus two reference-free


@dataclass
class BaseConfig:
    """What every training stage shares. Field names follow LLaMA-Factory / Hugging Face where one exists."""

    # -- model
    model_name_or_path: str = _opt("tiny", "Hugging Face model directory or hub id; a .gguf file (dequantised into a "
                                           "Hugging Face folder under the cache, once); 'tiny' builds the embedded "
                                           "demo model, 'tiny-vl' its vision-language twin (a small Qwen3-VL)")
    gguf_file: str | None = _opt(None, "A GGUF file inside the model_name_or_path folder, as transformers' gguf_file: "
                                       "the two join into one .gguf path")
    trust_remote_code: bool = _opt(False, "Allow custom modelling code shipped with the model (off: it runs arbitrary "
                                          "Python)")
    attn_implementation: str = _opt("auto", "auto (flash_attention_2 -> sdpa -> eager) | flash_attention_2 | sdpa | "
                                            "eager")
    model_dtype: str = _opt("auto", "Weights dtype on load: auto (fp32 for full/freeze, bf16/fp16 base for lora when "
                                    "mixed precision is on) | float32 | bfloat16 | float16")
    finetuning_type: str = _opt("lora", "full | lora | oft (orthogonal fine-tuning on the LoRA targets) | freeze "
                                        "(train only the last freeze_trainable_layers blocks)")
    lora_rank: int = _opt(8, "LoRA rank r")
    lora_alpha: int | None = _opt(None, "LoRA alpha (default: 2 * lora_rank, as LLaMA-Factory)")
    lora_dropout: float = _opt(0.0, "Dropout on the LoRA branch")
    lora_target: str = _opt("all", "Comma-separated module names for LoRA, or 'all' = every linear layer except the "
                                   "output head")
    additional_target: str | None = _opt(None, "Comma-separated extra modules trained in full and saved with the "
                                               "adapter (e.g. embed_tokens,lm_head)")
    freeze_trainable_layers: int = _opt(2, "With finetuning_type=freeze: train the last N blocks (negative: the first "
                                           "N)")
    freeze_vision_tower: bool = _opt(True, "Vision-language models: the vision encoder takes no gradient (and, with "
                                           "lora_target: all, no adapter)")
    freeze_multi_modal_projector: bool = _opt(True, "Vision-language models: the projector from vision features to the "
                                                    "language model (Qwen's merger, LLaVA's multi_modal_projector) "
                                                    "takes no gradient")
    freeze_language_model: bool = _opt(False, "Vision-language models: the language model takes no gradient (train the "
                                              "vision side only)")
    gradient_checkpointing: bool = _opt(False, "Recompute activations in backward to save memory")
    quantization_bit: int | None = _opt(None, "QLoRA: load the base model in 4 or 8 bits through bitsandbytes and "
                                              "train adapters over it (finetuning_type lora); the reference is the "
                                              "quantised base with the adapter off")
    quantization_method: str = _opt("bnb", "Quantisation library: bnb (bitsandbytes), the only one supported")
    quantization_type: str = _opt("nf4", "4-bit data type: nf4 (QLoRA's NormalFloat) | fp4")
    double_quantization: bool = _opt(True, "4-bit: quantise the quantisation constants too (QLoRA's double "
                                           "quantisation)")
    disable_dropout: bool = _opt(True, "Zero the model's own dropout (its dropout layers and attention dropout), as "
                                       "TRL does: the policy then equals its reference at the start and rollout "
                                       "log-probs equal the loss's; lora_dropout still applies")
    router_aux_loss_coef: float | None = _opt(None, "Mixture-of-experts models: weight of the router's load-balancing "
                                                    "loss, added to every trainer's loss and logged as moe/aux_loss "
                                                    "(default: the model's own router_aux_loss_coef; 0: off)")
    torch_compile: bool = _opt(False, "torch.compile the training step: each decoder block's forward and backward and "
                                      "the output head's chunked loss (HF/TRL's name); a block that fails to compile "
                                      "runs eagerly, with a warning. Compiled kernels are cached in "
                                      "$RLHF_CACHE/torch_compile across runs")
    # -- data
    dataset: str = _opt("", "Comma-separated dataset names from dataset_dir/dataset_info.json, or paths to "
                            "JSON/JSONL/Parquet files or dataset directories")
    eval_dataset: str = _opt("", "Held-out prompts with an 'answer' (for exact-match accuracy), same syntax as dataset")
    dataset_dir: str = _opt("data", "Folder holding dataset_info.json and the files it names")
    template: str = _opt("auto", "Chat template: auto (the model's own, else 'default') or a LLaMA-Factory name: "
                                 "llama3 | llama2 | mistral | qwen | qwen3 | qwen3_nothink | gemma | gemma3 | phi | "
                                 "chatml | default | empty; vision-language: qwen2_vl | qwen3_vl | qwen3_vl_nothink | "
                                 "llava")
    enable_thinking: bool | None = _opt(None, "Thinking switch of templates that have one (Qwen3): false puts an empty "
                                              "reasoning block in the prompt, so answers train without one (default: "
                                              "the template's own)")
    image_max_pixels: int = _opt(768 * 768, "Vision-language data: an image larger than this (width x height) is "
                                            "scaled down, aspect kept, before the model's image processor")
    image_min_pixels: int = _opt(32 * 32, "Vision-language data: an image smaller than this is scaled up")
    video_max_pixels: int = _opt(256 * 256, "Accepted for LLaMA-Factory configs; videos are not supported (a record "
                                            "with videos is an error)")
    media_dir: str = _opt("", "Folder that image paths in the data are relative to (default: dataset_dir)")
    cutoff_len: int = _opt(2048, "Maximum tokens per example; longer ones are truncated (or dropped if no target token "
                                 "survives), and counted")
    max_samples: int | None = _opt(None, "Use at most this many records from each dataset")
    val_size: float = _opt(0.0, "Hold out this share (0-1) or count (>=1) of training records for eval loss / "
                                "perplexity")
    val_split_by_prompt: bool = _opt(False, "Hold out whole prompts: every record of a held-out prompt goes to "
                                            "validation (no prompt on both sides; for data with several pairs per "
                                            "prompt)")
    streaming: bool = _opt(False, "Stream the dataset from disk in constant memory (needs max_steps)")
    buffer_size: int = _opt(0, "Shuffle buffer for streaming (0: file order, exactly resumable)")
    preprocessing_num_workers: int | None = _opt(None, "Processes for tokenisation (datasets.map num_proc)")
    dataloader_num_workers: int = _opt(0, "DataLoader worker processes")
    group_by_length: bool = _opt(False, "Batch examples of similar length together (less padding; order stays seeded "
                                        "and resumable)")
    skip_invalid_records: bool = _opt(False, "Skip (and count) malformed records instead of stopping at the first one")
    cache_dir: str | None = _opt(None, "Cache for the embedded model and tokenised data (default: $RLHF_CACHE or "
                                       "~/.cache/rlhf)")
    # -- optimisation
    output_dir: str = _opt("outputs/run", "Where checkpoints, the final model, logs and report.json go")
    overwrite_output_dir: bool = _opt(False, "Delete existing checkpoints in output_dir and start over")
    seed: int = _opt(42, "Seed for model init, data order and dropout")
    learning_rate: float = _opt(5e-5, "Peak learning rate (AdamW)")
    weight_decay: float = _opt(0.0, "AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.999, "AdamW beta2")
    adam_epsilon: float = _opt(1e-8, "AdamW epsilon")
    optim: str = _opt("adamw_torch", "AdamW kernel, Hugging Face's names: adamw_torch (per tensor) | adamw_torch_fused "
                                     "(one fused pass over all tensors: far fewer kernel launches, so much faster "
                                     "steps for models of many small tensors; where the device has it)")
    max_grad_norm: float = _opt(1.0, "Clip the global gradient norm to this (0: no clipping)")
    per_device_train_batch_size: int = _opt(8, "Micro-batch size per device")
    per_device_eval_batch_size: int = _opt(16, "Batch size for evaluation and generation")
    gradient_accumulation_steps: int = _opt(1, "Micro-batches per optimizer step; the loss is normalised over all of "
                                               "them")
    num_train_epochs: float = _opt(1.0, "Passes over the training data (ignored when max_steps > 0)")
    max_steps: int = _opt(-1, "Optimizer steps to run; > 0 overrides num_train_epochs")
    lr_scheduler_type: str = _opt("linear", "Learning-rate schedule from transformers: " + " | ".join(SCHEDULERS[:6])
                                            + " | ...")
    warmup_ratio: float = _opt(0.0, "Share of steps spent warming up the learning rate")
    warmup_steps: int = _opt(0, "Warm-up steps (overrides warmup_ratio when > 0)")
    bf16: bool = _opt(False, "bfloat16 mixed precision (GPU, or CPU autocast)")
    fp16: bool = _opt(False, "float16 mixed precision with loss scaling (CUDA only)")
    ddp_timeout: int = _opt(1800, "Seconds before a distributed collective times out")
    # -- logging, evaluation, checkpoints
    logging_steps: int = _opt(10, "Log metrics every N optimizer steps")
    mfu_peak_flops: float | None = _opt(None, "The device's peak FLOP/s that perf/mfu is measured against (default: "
                                              "a known GPU's bf16 peak, half of it in float32; a CPU's matmul rate, "
                                              "measured once and cached)")
    eval_steps: int = _opt(0, "Evaluate every N optimizer steps (0: only at the end)")
    eval_max_new_tokens: int = _opt(64, "Token budget per answer when evaluating accuracy by generation")
    eval_before_training: bool = _opt(False, "Also evaluate the model before training, for a before/after table")
    save_steps: int = _opt(500, "Write a checkpoint every N optimizer steps (0: only at the end)")
    save_total_limit: int = _opt(3, "Keep only the newest N checkpoints")
    save_only_model: bool = _opt(False, "Checkpoints hold weights only (smaller; resume then restarts optimizer state)")
    resume_from_checkpoint: str = _opt("auto", "auto (latest complete checkpoint in output_dir, if any) | none | a "
                                               "checkpoint directory")
    early_stopping_patience: int | None = _opt(None, "Stop after N evaluations without improvement of "
                                                     "metric_for_best_model")
    metric_for_best_model: str = _opt("eval/loss", "Metric watched by early stopping; lower is better unless the name "
                                                   "contains 'accuracy'")
    report_to: list[str] = _opt([], "Experiment trackers: tensorboard, wandb (offline unless WANDB_API_KEY is set), "
                                    "all, or none")
    run_name: str | None = _opt(None, "Run name shown in trackers")
    logging_dir: str | None = _opt(None, "Folder for this stage's text log, <stage>.log (default: output_dir/logs)")
    plot_loss: bool = _opt(False, "Save loss and metric curves as PNG files in output_dir")
    disable_progress_bar: bool = _opt(False, "Hide the rich progress bar (logs still print)")
    progress_interval: float = _opt(30.0, "Seconds between plain progress lines (step/total, rate, ETA, last loss) "
                                          "when output is not a terminal (a pipe, a CI log, a file), where no bar is "
                                          "drawn")
    max_nonfinite_steps: int = _opt(5, "Steps in a row with a non-finite loss, reward or gradient (each skipped) "
                                       "before the run stops after a checkpoint")
    # -- protecting earlier skills (policy-optimisation stages: the DPO family, kto and the online stages)
    ewc_lambda: float = _opt(0.0, "Elastic weight consolidation: lambda/2 * sum_i F_i (theta_i - theta0_i)^2 pulls "
                                  "trainable weights towards this stage's starting weights, F = diagonal Fisher on "
                                  "ewc_dataset (0: off)")
    ewc_dataset: str = _opt("", "SFT-format dataset whose likelihood EWC protects (the pipeline fills in its sft "
                                "stage's dataset)")
    ewc_samples: int = _opt(64, "Examples of ewc_dataset used to estimate the diagonal Fisher")

    stage: typing.ClassVar[str] = "base"

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    def _normalise(self) -> None:
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        targets = [t.strip() for item in self.report_to for t in str(item).split(",") if t.strip()]
        if "all" in targets:
            targets = list(REPORT_TARGETS)
        self.report_to = [t for t in targets if t != "none"]
        if self.lora_alpha is None:
            self.lora_alpha = 2 * self.lora_rank
        if self.gguf_file:  # transformers' (folder, gguf_file) pair is one path here, which every stage loads alike
            self.model_name_or_path = str(Path(self.model_name_or_path) / self.gguf_file)
            self.gguf_file = None
        resume = str(self.resume_from_checkpoint).lower()
        if isinstance(self.resume_from_checkpoint, bool) or resume in ("true", "false", "none", "null", ""):
            self.resume_from_checkpoint = "auto" if resume == "true" else "none"

    def _validate(self) -> None:
        positive = ("learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps", "cutoff_len", "lora_rank", "logging_steps",
                    "save_total_limit", "eval_max_new_tokens", "max_nonfinite_steps")
        for name in positive:
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _check(self.mfu_peak_flops is None or self.mfu_peak_flops > 0, "mfu_peak_flops",
               f"must be the device's peak FLOP/s (> 0), got {self.mfu_peak_flops}")
        for name in ("weight_decay", "max_grad_norm", "warmup_steps", "save_steps", "eval_steps",
                     "buffer_size", "dataloader_num_workers", "num_train_epochs", "val_size"):
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _check(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        _check(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        _check(0 < self.adam_beta1 < 1 and 0 < self.adam_beta2 < 1, "adam_beta1/adam_beta2", "must be in (0, 1)")
        _check(self.max_steps > 0 or self.num_train_epochs > 0, "max_steps",
               "set max_steps > 0 or num_train_epochs > 0")
        _check(self.max_samples is None or self.max_samples > 0, "max_samples", "must be > 0 (or omit it)")
        _check(self.early_stopping_patience is None or self.early_stopping_patience > 0,
               "early_stopping_patience", "must be > 0 (or omit it)")
        _check_choice(self.finetuning_type, FINETUNING_TYPES, "finetuning_type")
        _check_choice(self.attn_implementation, ATTENTION_CHOICES, "attn_implementation")
        _check_choice(self.lr_scheduler_type, SCHEDULERS, "lr_scheduler_type")
        _check_choice(self.model_dtype, ("auto", "float32", "bfloat16", "float16"), "model_dtype")
        if self.quantization_bit is not None:
            _check(self.quantization_bit in (4, 8), "quantization_bit", f"must be 4 or 8, got {self.quantization_bit}")
            _check_choice(self.quantization_method, ("bnb",), "quantization_method")
            _check_choice(self.quantization_type, ("nf4", "fp4"), "quantization_type")
            _check(self.finetuning_type in ("lora", "oft"), "quantization_bit",
                   f"a quantised base trains adapters only; set finetuning_type: lora (it is {self.finetuning_type})")
        _check_choice(self.optim, ("adamw_torch", "adamw_torch_fused"), "optim")
        for target in self.report_to:
            _check_choice(target, REPORT_TARGETS + ("none", "all"), "report_to")
        _check(not (self.bf16 and self.fp16), "bf16/fp16", "choose one mixed-precision mode, not both")
        _check(bool(str(self.output_dir).strip()), "output_dir", "is empty; name a directory for this run's outputs")
        _check(not self.fp16 or torch.cuda.is_available(), "fp16",
               "float16 mixed precision needs a CUDA GPU; use bf16=true on CPU")
        _check(not self.streaming or self.max_steps > 0, "max_steps",
               "streaming datasets have no known length: set max_steps > 0")
        _check(self.val_size < 1 or float(self.val_size).is_integer(), "val_size",
               "use a share in [0, 1) or a whole number of records")
        _check(not (self.val_split_by_prompt and self.streaming), "val_split_by_prompt",
               "a stream's validation set is its first val_size records; turn one of them off")
        _check(self.ewc_lambda >= 0 and self.ewc_samples > 0, "ewc_lambda/ewc_samples", "must be >= 0 / > 0")
        if self.ewc_lambda:
            _check(self.stage in POLICY_OPTIMISATION_STAGES, "ewc_lambda",
                   f"only applies to policy-optimisation stages ({', '.join(POLICY_OPTIMISATION_STAGES)}); set it to 0 "
                   f"here")
            _check(bool(self.ewc_dataset.strip()), "ewc_dataset",
                   "must name the SFT dataset EWC protects when ewc_lambda > 0")

    @property
    def mixed_precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class OnlineRLConfig(BaseConfig):
    """What the online stages (grpo, rloo, reinforce_pp, online_dpo, distill, ppo) share: sampling of rollouts and
    the reward functions that score them."""

    max_completion_length: int = _opt(64, "Token budget per sampled completion")
    temperature: float = _opt(1.0, "Sampling temperature for rollouts (the loss uses the same scaled log-probs)")
    top_p: float = _opt(1.0, "Nucleus sampling mass for rollouts")
    top_k: int = _opt(0, "Sample among the k most likely tokens (0: all)")
    generation_engine: str = _opt("auto", "Rollout decoding: auto (a static KV cache; the decode step is compiled once "
                                          "a timed rollout shows the run's remaining rollouts would save more than the "
                                          "compilation costs) | compiled | static | eager")
    rollout_dtype: str = _opt("auto", "What our engine samples from, on a CPU: auto (the policy itself) | fp16 (a copy "
                                      "with fp16 linear weights: half the bytes per decode step, log-probs within "
                                      "rounding) | int8 (int8 weights and activations: a quarter of the bytes, a "
                                      "visibly different policy on real models); the copy is refreshed after every "
                                      "step and its gap corrected as vLLM's (vllm_importance_sampling_*)")
    reward_funcs: list[str] = _opt([], "Reward functions: exact_answer, format, length, reward_model, "
                                       "process_reward_model, api, or module:function")
    reward_weights: list[float] = _opt([], "One weight per reward function, in order (default: all 1.0)")
    reward_model: str | None = _opt(None, "Reward model (or ensemble) directory saved by the rm stage ('rm' in a "
                                          "pipeline: its rm stage)")
    process_reward_model: str | None = _opt(None, "Process reward model directory (prm stage; 'prm' in a pipeline), "
                                                  "for reward_funcs 'process_reward_model'")
    reward_model_type: str = _opt("full", "How reward_model is used: full | lora (an adapter over its base; both load "
                                          "from the directory) | api (reward_api_url)")
    reward_uncertainty_penalty: float = _opt(0.0, "Subtract this times the ensemble's std from the learned reward "
                                                  "(pessimism under uncertainty)")
    reward_api_url: str | None = _opt(None, "HTTP endpoint for reward_funcs 'api': POST {prompts, responses} -> "
                                            "{rewards}")
    reward_api_timeout: float = _opt(30.0, "Seconds before one reward API request times out")
    reward_api_retries: int = _opt(3, "Attempts per reward API request (exponential backoff between them)")
    length_target_chars: int = _opt(200, "Target completion length in characters for the 'length' reward")
    constitution: list[str] = _opt([], "Principles checked on every completion, as check[=arg][@weight]: answer_line, "
                                       "max_chars=N, no_repetition, regex=PATTERN, critique=TEXT (scored by the reward "
                                       "model)")
    reward_normalize: bool = _opt(False, "Normalise rewards by a running mean/std before computing advantages")
    reward_clip: float | None = _opt(None, "Clip (normalised) rewards to [-reward_clip, reward_clip]")
    ref_model: str | None = _opt(None, "Reference model directory (default: the starting model; LoRA uses the "
                                       "adapter-disabled base)")
    overlong_buffer_len: int = _opt(0, "DAPO's overlong shaping: completions longer than max_completion_length minus "
                                       "this many tokens lose reward linearly (0: off)")
    overlong_penalty_factor: float = _opt(1.0, "The penalty at max_completion_length (and beyond) of the overlong "
                                               "shaping")
    min_p: float = _opt(0.0, "Sample only tokens with probability >= min_p times the most likely one's (vLLM engine)")
    repetition_penalty: float = _opt(1.0, "Penalise tokens already in the prompt or completion (> 1; vLLM engine)")
    use_vllm: bool | str = _opt(False, "Sample rollouts (and the online evaluation's answers) with vLLM instead of "
                                       "our engine; auto: with vLLM installed, a colocated vLLM samples one trial "
                                       "rollout after one of ours, and the faster per rollout (weight sync included) "
                                       "samples the rest; install: docs/vllm.md")
    vllm_mode: str = _opt("colocate", "colocate (vLLM inside the trainer's process, sharing its device) | server (a "
                                      "`python rlhf.py vllm-serve` process)")
    vllm_gpu_memory_utilization: float = _opt(0.3, "colocate on a GPU: the share of GPU memory vLLM takes (weights and "
                                                   "KV cache)")
    vllm_tensor_parallel_size: int = _opt(1, "colocate on GPUs: how many GPUs vLLM shards the model over")
    vllm_enable_sleep_mode: bool = _opt(False, "colocate on a GPU: free vLLM's weights and KV cache while the policy "
                                               "trains")
    vllm_max_model_len: int | None = _opt(None, "Longest prompt + completion vLLM plans its KV cache for (default: the "
                                                "model's)")
    vllm_server_host: str = _opt("127.0.0.1", "server mode: the host of `rlhf.py vllm-serve`")
    vllm_server_port: int = _opt(8000, "server mode: its port")
    vllm_server_timeout: float = _opt(600.0, "server mode: seconds one request may take before it is retried")
    vllm_server_retries: int = _opt(3, "server mode: attempts per request (exponential backoff between them)")
    sync_timeout: float = _opt(600.0, "server mode: seconds a weight sync (a load, with its wait for the running "
                                      "requests; a weight group's join; a broadcast) may take before the run stops, "
                                      "with one line saying how to resume")
    vllm_weight_transfer: str = _opt("auto", "server mode: how full weights reach the server: files (safetensors "
                                             "shards in vllm_sync_dir, which both read) | collective (broadcast "
                                             "through a process group of trainer and server: NCCL from a GPU, gloo "
                                             "from a CPU; reaches another machine) | auto (collective from a GPU, "
                                             "files from a CPU)")
    vllm_sync_dir: str | None = _opt(None, "server mode, files: a folder trainer and server both read, where each "
                                           "weight sync is written (default: a new one in /dev/shm)")
    vllm_old_logprobs: str = _opt("trainer", "Old log-probs of the loss's ratio: trainer (one extra forward; the "
                                             "engine's mismatch is corrected by importance sampling) | engine (vLLM's "
                                             "own, no extra forward, no correction)")
    vllm_importance_sampling_correction: bool = _opt(True, "Reweight each token by the trainer's over the engine's "
                                                           "probability of it, capped (Yao et al. 2025)")
    vllm_importance_sampling_mode: str = _opt("token_truncate", "token_truncate: min(rho, C) per token | token_mask: "
                                                                "drop tokens with rho outside [1/C, C] | "
                                                                "sequence_truncate / sequence_mask: the same on each "
                                                                "sequence's ratio")
    vllm_importance_sampling_cap: float = _opt(2.0, "C, the cap of the importance-sampling correction")
    vllm_servers: list[str] | None = _opt(None, "server mode: several servers (host:port each) instead of "
                                                "vllm_server_host/port; each rollout's prompts are spread across "
                                                "them, each gets every weight sync, a dead one is taken out and tried "
                                                "again at the next sync")
    max_staleness: int = _opt(0, "server mode: sample up to this many optimizer steps ahead of training, in the "
                                 "background (fully async rollouts): a completion is trained on at most k steps after "
                                 "the weights that sampled it, older ones are dropped and counted; 0: on-policy")
    async_rollouts: bool = _opt(False, "server mode: max_staleness: 1, the next rollout sampled while this one "
                                       "trains (one step off-policy; corrected by importance sampling)")
    rollout_scheduler: str = _opt("auto", "When rollouts are sampled (ROLLOUT_SCHEDULERS): auto (sync, or "
                                          "bounded_staleness when max_staleness > 0) | sync (on-policy) | "
                                          "bounded_staleness (up to max_staleness steps ahead, in the background; a "
                                          "weight sync waits for the server's running requests) | in_flight (the same, "
                                          "and a sync updates the server's weights under its running requests, each "
                                          "token tagged with the version that sampled it; server mode) | a name "
                                          "registered with rlhf.register_rollout_scheduler")
    rollout_retries: int = _opt(2, "Retries of an environment or reward call that raises or times out; after them its "
                                   "episode is dropped (its group left out of the loss) and counted in "
                                   "rollout/failed_episodes")
    rollout_timeout: float = _opt(1800.0, "Seconds a rollout may go without progress (a turn sampled, an environment "
                                          "or reward call answered) before the run stops with a line naming what "
                                          "hung; 0: no limit")

    stage: typing.ClassVar[str] = "online"
    scored_by_rewards: typing.ClassVar[bool] = True  # False: distillation, whose signal is a teacher

    def _validate(self) -> None:
        super()._validate()
        _check(self.max_completion_length > 0, "max_completion_length", "must be > 0")
        _check(self.temperature > 0 and 0 < self.top_p <= 1 and self.top_k >= 0, "temperature/top_p/top_k",
               "need temperature > 0, 0 < top_p <= 1 and top_k >= 0")
        _check_choice(self.reward_model_type, ("full", "lora", "api"), "reward_model_type")
        _check_choice(self.generation_engine, ("auto", "compiled", "static", "eager"), "generation_engine")
        _check_choice(self.rollout_dtype, ROLLOUT_DTYPES, "rollout_dtype")
        _check(self.use_vllm in (True, False, "auto"), "use_vllm", f"is {self.use_vllm!r}: give true, false or auto")
        _check(self.rollout_dtype == "auto" or self.use_vllm is False, "rollout_dtype",
               "is our engine's; vLLM samples in its own dtype: set use_vllm: false or rollout_dtype: auto")
        if not self.scored_by_rewards:
            _check(not self.reward_names(), "reward_funcs",
                   f"is unused by the {self.stage} stage (the teacher is its signal): remove it")
        _check(self.rollout_retries >= 0 and self.rollout_timeout >= 0, "rollout_retries/rollout_timeout",
               "need rollout_retries >= 0 and rollout_timeout >= 0 (0: no limit)")
        _check(bool(self.reward_names()) or not self.scored_by_rewards or getattr(self, "environment", None) == "agent",
               "reward_funcs",
               "is empty: name at least one, e.g. reward_funcs=exact_answer,format (or set reward_model)")
        _check(not self.reward_weights or len(self.reward_weights) == len(self.reward_names()), "reward_weights",
               f"needs one weight per reward function ({', '.join(self.reward_names())})")
        _check(self.reward_api_timeout > 0 and self.reward_api_retries >= 1, "reward_api_timeout/reward_api_retries",
               "need a positive timeout and at least one attempt")
        _check(self.reward_clip is None or self.reward_clip > 0, "reward_clip", "must be > 0 (or omit it)")
        _check(self.reward_uncertainty_penalty >= 0, "reward_uncertainty_penalty", "must be >= 0")
        _check(0 <= self.overlong_buffer_len < self.max_completion_length, "overlong_buffer_len",
               f"must be >= 0 and below max_completion_length ({self.max_completion_length})")
        _check(self.overlong_penalty_factor >= 0, "overlong_penalty_factor", "must be >= 0")
        self._validate_sampling_engine()
        _check_choice(self.rollout_scheduler, ("auto", *ROLLOUT_SCHEDULERS), "rollout_scheduler")
        _check(not (self.rollout_scheduler == "sync" and self.max_staleness), "rollout_scheduler",
               "sync samples on-policy: set max_staleness: 0 (and async_rollouts: false), or rollout_scheduler: auto")
        _check(self.rollout_scheduler not in ("bounded_staleness", "in_flight") or self.max_staleness > 0,
               "rollout_scheduler", f"{self.rollout_scheduler} samples up to max_staleness steps ahead: set "
               f"max_staleness >= 1")
        _check(self.rollout_scheduler != "in_flight" or self.finetuning_type != "lora", "rollout_scheduler",
               "in_flight cannot update a LoRA policy under running requests: vLLM fixes each request's LoRA adapter "
               "when it starts; use rollout_scheduler: bounded_staleness with LoRA")

    def _validate_sampling_engine(self) -> None:
        _check(0 <= self.min_p < 1 and self.repetition_penalty > 0, "min_p/repetition_penalty",
               "need 0 <= min_p < 1 and repetition_penalty > 0")
        if self.use_vllm is not True:  # our engine samples (auto: at least the first rollout)
            _check(self.min_p == 0 and self.repetition_penalty == 1.0, "min_p/repetition_penalty",
                   "are sampled by vLLM only: set use_vllm: true, or leave them at 0 and 1")
            _check(not self.async_rollouts and not self.max_staleness, "async_rollouts/max_staleness",
                   "sample with a vLLM server: set use_vllm: true and vllm_mode: server")
            _check(not self.vllm_servers, "vllm_servers", "are vLLM servers: set use_vllm: true and vllm_mode: server")
            _check(self.use_vllm is False or self.vllm_mode == "colocate", "use_vllm",
                   "auto measures a colocated vLLM against our engine; with a server set use_vllm: true")
            if self.use_vllm is False:
                return
        elif self.vllm_mode != "server":  # a server's trainer speaks HTTP and torch.distributed: no vLLM of its own
            missing = vllm_missing()
            _check(not missing, "use_vllm", missing)
        _check_choice(self.vllm_mode, VLLM_MODES, "vllm_mode")
        _check_choice(self.vllm_weight_transfer, ("auto", *WEIGHT_TRANSFERS), "vllm_weight_transfer")
        _check_choice(self.vllm_old_logprobs, VLLM_OLD_LOGPROBS, "vllm_old_logprobs")
        _check_choice(self.vllm_importance_sampling_mode, IMPORTANCE_SAMPLING_MODES, "vllm_importance_sampling_mode")
        _check(self.vllm_importance_sampling_cap > 1, "vllm_importance_sampling_cap", "must be > 1")
        _check(0 < self.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization", "must be in (0, 1]")
        _check(self.vllm_tensor_parallel_size >= 1, "vllm_tensor_parallel_size", "must be >= 1")
        _check(1 <= self.vllm_server_port < 65536, "vllm_server_port", "must be a port number (1-65535)")
        _check(self.vllm_server_timeout > 0 and self.vllm_server_retries >= 1,
               "vllm_server_timeout/vllm_server_retries", "need a positive timeout and at least one attempt")
        _check(self.sync_timeout > 0, "sync_timeout", "must be a positive number of seconds")
        _check(self.max_staleness >= 0, "max_staleness", "must be >= 0 (0: on-policy)")
        if self.async_rollouts and not self.max_staleness:
            self.max_staleness = 1
        _check(not self.max_staleness or self.vllm_mode == "server", "async_rollouts/max_staleness",
               "needs vllm_mode: server (a colocated engine shares the trainer's device, so it cannot sample while it "
               "trains)")
        _check(not (self.max_staleness and self.vllm_old_logprobs == "engine"), "vllm_old_logprobs",
               "must be 'trainer' with async rollouts: the engine's log-probs are of older weights than the policy "
               "being trained")
        _check(not self.vllm_servers or self.vllm_mode == "server", "vllm_servers", "needs vllm_mode: server")
        for entry in self.vllm_servers or []:
            _check(bool(re.fullmatch(r"(https?://)?[^\s:/]+:\d{1,5}/?", str(entry))), "vllm_servers",
                   f"entry {entry!r} is not host:port (e.g. 127.0.0.1:8000)")
        truncated = bool(self.top_k) or self.top_p < 1 or self.min_p > 0 or self.repetition_penalty != 1.0
        _check(not (self.vllm_old_logprobs == "engine" and truncated), "vllm_old_logprobs",
               "is 'engine', but with top_k, top_p < 1, min_p or repetition_penalty vLLM's log-probs are of the "
               "narrowed distribution it sampled from, not the policy's: use 'trainer'")
        _check(not (self.repetition_penalty != 1.0 and self.vllm_importance_sampling_correction), "repetition_penalty",
               "cannot be replayed by the trainer, so the importance-sampling correction would be biased: leave it at "
               "1.0 or set vllm_importance_sampling_correction: false")

    def reward_names(self) -> list[str]:
        """The reward functions in order; a reward model (or reward API) not named in reward_funcs is appended."""
        names = list(self.reward_funcs)
        api_already = self.reward_model_type == "api" and "api" in names
        if (self.reward_model or self.reward_model_type == "api") and "reward_model" not in names and not api_already:
            names.append("reward_model")
        if self.process_reward_model and "process_reward_model" not in names:
            names.append("process_reward_model")
        return names


# Stages the orchestrator runs after training, on the trained models. A model is named by the stage that
# produced it ("sft", "rm", ...) or by a directory; prompts default to the pipeline's eval_dataset.
FINAL_STAGES = ("eval", "best_of_n", "merge")
FINAL_STAGE_OPTIONS: dict[str, dict[str, Any]] = {
    # every adopted policy: held-out accuracy, mean reward of greedy answers, KL to the reference on samples;
    # the final policy also: diversity, win rate over the reference, reward accuracy on ``pairs``
    "eval": {"prompts": None, "max_prompts": 100, "samples_per_prompt": 2, "reward_model": "rm", "reference": "sft",
             "pairs": None, "max_pairs": 200, "max_new_tokens": None, "batch_size": 100, "use_vllm": False},
    # n samples per prompt from the final policy, reranked by each scorer: rm (the reward model) or vote
    # (self-consistency: the most frequent answer, Wang et al. 2023)
    "best_of_n": {"n": 8, "prompts": None, "max_prompts": 100, "temperature": 1.0, "scorers": ["rm", "vote"],
                  "reward_model": "rm", "max_new_tokens": None, "seed": 0, "use_vllm": False},
    # model_merging.MergeConfig keys; models default to every adopted policy-optimisation stage
    "merge": {"method": "ties", "models": None, "base_model": "sft", "density": 0.5, "evaluate": True},
}


FINAL_STAGE_NUMBERS: dict[str, dict[str, str]] = {  # what each numeric key of a final stage must hold
    "eval": {"max_prompts": "count", "samples_per_prompt": "count", "max_pairs": "count", "max_new_tokens": "count",
             "batch_size": "count"},
    "best_of_n": {"n": "count", "max_prompts": "count", "temperature": "temperature", "max_new_tokens": "count",
                  "seed": "seed"},
}


FINAL_STAGE_HELP: dict[str, dict[str, str]] = {  # what `pipeline --help` says about each final-stage key
    "eval": {"prompts": "held-out prompts with answers (default: the pipeline's eval_dataset)",
             "max_prompts": "prompts scored for reward and KL (accuracy uses every prompt)",
             "samples_per_prompt": "samples per prompt for the KL estimate",
             "reward_model": "the reward model scoring greedy answers: a stage name or a directory (null, or a stage "
             "that did not run: no reward metrics)",
             "reference": "the policy KL is measured against", "pairs": "preference pairs for the reward "
             "model's pairwise accuracy (optional)", "max_pairs": "pairs read from pairs",
             "max_new_tokens": "generation length (default: eval_max_new_tokens)",
             "batch_size": "prompts per generation batch",
             "use_vllm": "generate with vLLM (one engine per policy scored; install: docs/vllm.md)"},
    "best_of_n": {"n": "samples per prompt", "prompts": "as in eval", "max_prompts": "prompts used",
                  "temperature": "sampling temperature", "scorers": "rm (the reward model) and/or vote (the most "
                  "frequent answer)", "reward_model": "the model behind the rm scorer",
                  "max_new_tokens": "generation length (default: eval_max_new_tokens)", "seed": "sampling seed",
                  "use_vllm": "sample with vLLM (install: docs/vllm.md)"},
    "merge": {"method": "a model_merging method (ties, dare_ties, slerp, linear, ...)",
              "models": "the policies to merge (default: every adopted preference or RL stage)",
              "base_model": "the model they were fine-tuned from", "density": "share of each task vector kept",
              "evaluate": "evaluate the merged model like the others; any other merge config key (lambda, t, "
              "majority_sign_method, normalize, dtype, seed, ...) is passed to model_merging.py"},
}


def _check(ok: bool, name: str, fix: str) -> None:
    if not ok:
        raise RLHFInputError(f"config field '{name}' {fix}")


def _check_choice(value: str, choices: Iterable[str], name: str) -> None:
    choices = tuple(choices)
    if value not in choices:
        hint = difflib.get_close_matches(str(value), choices, n=1)
        suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise RLHFInputError(f"config field '{name}' is '{value}'{suggestion}; valid: {', '.join(choices)}")


# LLaMA-Factory / HF Trainer keys that users' YAML files carry. Each either maps to one of ours
# (value: our field name, optionally with a value translation) or is ignored with the reason given.
LLAMAFACTORY_RENAMES: dict[str, tuple[str, dict[Any, Any] | None]] = {
    "flash_attn": ("attn_implementation", {"fa2": "flash_attention_2", "sdpa": "sdpa", "disabled": "eager",
                                           "auto": "auto"}),
    "neat_packing": ("packing", None),
    "infer_dtype": ("model_dtype", {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16",
                                    "float16": "float16"}),
    "eval_dataset_dir": ("dataset_dir", None),
    "lora_targets": ("lora_target", None),
    "moe_aux_loss_coef": ("router_aux_loss_coef", None),
    "compile": ("torch_compile", None),  # this project's own name for it before it took HF's
}
# The same knobs under TRL's, OpenRLHF's and verl's names (their config files, flattened), for the stages that have
# them; in a stage without the knob the key is an error like any unknown key.
TRL_OPENRLHF_RENAMES: dict[str, tuple[str, dict[Any, Any] | None]] = {
    "teacher_model_name_or_path": ("teacher_model", None),        # TRL GKDConfig
    "epsilon": ("epsilon_low", None),                             # TRL GRPOConfig
    "n_samples_per_prompt": ("num_generations", None),            # OpenRLHF
    "dynamic_filtering": ("dynamic_sampling", None),              # OpenRLHF
    "adv_estimator": ("advantage_estimator", None),               # verl (its values: ADVANTAGE_ESTIMATOR_ALIASES)
    "clip_ratio_low": ("epsilon_low", None),                      # verl
    "clip_ratio_high": ("epsilon_high", None),                    # verl
    "loss_agg_mode": ("loss_type", {"token-mean": "dapo", "seq-mean-token-mean": "grpo",
                                    "seq-mean-token-sum-norm": "dr_grpo"}),  # verl
}
KEY_RENAMES = {**LLAMAFACTORY_RENAMES, **TRL_OPENRLHF_RENAMES}
LLAMAFACTORY_IGNORED: dict[str, str] = {
    "do_train": "rlhf always trains the stage it is asked to run",
    "do_eval": "evaluation runs every eval_steps (0: at the end)",
    "do_predict": "use the evaluation of the stage or the best-of-n command instead",
    "eval_strategy": "evaluation runs every eval_steps (0: at the end)",
    "evaluation_strategy": "evaluation runs every eval_steps (0: at the end)",
    "save_strategy": "checkpoints are written every save_steps",
    "logging_strategy": "metrics are logged every logging_steps",
    "overwrite_cache": "tokenised data is cached by a hash of the data, tokenizer and settings, so it never goes stale",
    "deepspeed": "the accelerate launch picks the engine: `accelerate launch --config_file "
                 "configs/accelerate/deepspeed_zero3.yaml rlhf.py ...`",
    "fsdp": "launch with an accelerate FSDP config file instead",
    "upcast_layernorm": "norm layers already stay in fp32 under autocast",
    "pure_bf16": "use bf16=true (mixed precision) or model_dtype=bfloat16",
    "enable_liger_kernel": "Liger's kernels are not used; what its fused linear cross-entropy saves, the chunked "
                           "output layer (OutputHead) already saves for every loss, on any device",
    "use_unsloth": "Unsloth is not used",
    "resize_vocab": "the vocabulary is never resized",
    "tokenized_path": "tokenised data is cached automatically under cache_dir",
    "mix_strategy": "datasets are concatenated",
    "push_to_hub": "outputs are written to output_dir only",
    "hub_model_id": "outputs are written to output_dir only",
    "plot_only": "plots are written at the end of training when plot_loss is true",
    "ray_run_name": "Ray is not used",
    "include_num_input_tokens_seen": "tokens/s is always logged",
    "dataloader_pin_memory": "pinning is decided from the device",
    "bf16_full_eval": "evaluation uses the training precision",
    "predict_with_generate": "accuracy evaluation always generates",
}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _split_list(text: str) -> list[str]:
    """A comma-separated command-line list. Commas inside brackets, braces or parentheses (a regex's
    ``{1,3}`` or ``[a,b]``) and escaped ones (``\\,``) stay in their item; a YAML list (``'[a, "b,c"]'``)
    never reaches here."""
    items, current, depth, escaped = [], [], 0, False
    for char in text:
        if escaped:
            current.append(char if char == "," else "\\" + char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            depth += 1 if char in "([{" else -1 if char in ")]}" and depth > 0 else 0
            current.append(char)
    if escaped:
        current.append("\\")
    if depth:
        raise ValueError("a bracket opened in this list is never closed, so its commas cannot be told apart; "
                         "escape the commas inside an item as \\, or give a YAML list ('[\"a,b\", c]')")
    items.append("".join(current))
    return items


def _coerce(value: Any, annotation: Any, name: str, where: str) -> Any:
    """Turn a YAML / command-line value into the field's declared type, or explain why not."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none") and type(None) in args):
            if type(None) in args:
                return None
        non_none = [a for a in args if a is not type(None)]
        if non_none == [bool, str]:  # true / false, or a word (use_vllm: auto)
            if isinstance(value, bool):
                return value
            word = str(value).strip().lower()
            return {"true": True, "1": True, "yes": True, "on": True,
                    "false": False, "0": False, "no": False, "off": False}.get(word, word)
        return _coerce(value, non_none[0], name, where)
    if origin is list:
        try:
            items = value if isinstance(value, list) else [v for v in _split_list(str(value)) if v.strip()]
        except ValueError as error:
            raise RLHFInputError(f"{where}: '{name}': {error}") from None
        return [_coerce(v, args[0], name, where) for v in items]
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            lowered = str(value).strip().lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if annotation is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return "" if value is None else str(value)  # null / ~ unsets a text field, never the text "None"
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}[annotation]
        raise RLHFInputError(f"{where}: '{name}' must be {kind}, got {value!r}") from None
    return value


def _translate_keys(raw: dict[str, Any], cls: type[BaseConfig], where_of: Callable[[str], str]) -> dict[str, Any]:
    """Map LLaMA-Factory names onto ours, drop ignored ones with a notice, reject unknown keys. Messages say
    where each key was given (``where_of``: file:line, or the command line)."""
    known = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        where = where_of(key)
        if key == "stage":
            if str(value) != cls.stage:
                raise RLHFInputError(
                    f"{where}: stage: {value} but this command trains '{cls.stage}'; "
                    f"run `python rlhf.py {value} --config ...` (or `python rlhf.py train`, which reads stage)")
            continue
        if key in known:
            out[key] = value
        elif key in KEY_RENAMES:
            target, mapping = KEY_RENAMES[key]
            if target not in known and key in TRL_OPENRLHF_RENAMES:
                raise RLHFInputError(f"{where}: '{key}' is '{target}' here, which the {cls.stage} stage does not have "
                                     f"(see `python rlhf.py {cls.stage} --help`)")
            if target not in known:
                logger.info("%s: ignoring '%s' (no '%s' in the %s stage)", where, key, target, cls.stage)
                continue
            if mapping is not None:
                if value not in mapping:
                    raise RLHFInputError(f"{where}: '{key}' is {value!r}; valid: {', '.join(map(str, mapping))}")
                value = mapping[value]
            if target in raw and raw[target] != value:
                raise RLHFInputError(f"{where}: '{key}' ({value!r}) and '{target}' ({raw[target]!r}) are both set; "
                                     "keep one")
            out[target] = value
        elif key in LLAMAFACTORY_IGNORED:
            logger.info("%s: ignoring '%s': %s", where, key, LLAMAFACTORY_IGNORED[key])
        else:
            hint = difflib.get_close_matches(key, sorted(known | set(KEY_RENAMES)), n=1)
            suggestion = f"; did you mean '{hint[0]}'?" if hint else ""
            raise RLHFInputError(f"{where}: unknown key '{key}' for the {cls.stage} stage{suggestion} "
                                 f"(see `python rlhf.py {cls.stage} --help`)")
    return out


def parse_overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """``key=value`` strings from the command line; values are parsed as YAML scalars."""

    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise RLHFInputError(f"command line: '{pair}' is not key=value (e.g. learning_rate=1e-4)")
        key, value = pair.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


_YAML_KEY_LINES: dict[str, dict[tuple[str, ...], int]] = {}  # config file -> (section, key) or (key,) -> line


def _yaml_key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The 1-based line of every top-level key, and of every key one level down (a stage section's), so that
    a message about a key can point at it."""

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    lines: dict[tuple[str, ...], int] = {}
    if isinstance(root, yaml.MappingNode):
        for key, value in root.value:
            lines[(str(key.value),)] = key.start_mark.line + 1
            if isinstance(value, yaml.MappingNode):
                for sub, _ in value.value:
                    lines[(str(key.value), str(sub.value))] = sub.start_mark.line + 1
    return lines


def _key_where(source: str, section: str | None, key: str) -> str:
    """Where a config key was written, for messages: ``file:line``, ``file:line on the 7b preset [sft]``; the
    file alone when the key is not in it (a preset's, or one the pipeline sets)."""
    path, _, preset = source.partition(" on the ")
    lines = _YAML_KEY_LINES.get(path, {})
    line = (lines.get((section, key)) if section else None) or lines.get((key,))
    return ((f"{path}:{line}" if line else path) + (f" on the {preset}" if preset else "")
            + (f" [{section}]" if section else ""))


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML mapping from a file, with syntax errors reported as file:line; the lines of its keys are kept
    for later messages about them."""

    path = Path(path)
    if path.is_dir():
        raise RLHFInputError(f"config file {path} is a directory; give a YAML file")
    if not path.is_file():
        raise RLHFInputError(f"config file {path} does not exist")
    from model_merging import DuplicateYAMLKeyError, unique_key_yaml_loader

    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.load(text, Loader=unique_key_yaml_loader()) or {}
    except DuplicateYAMLKeyError as err:
        raise RLHFInputError(f"{path}:{err.line}: duplicate key '{err.key}' (first at line {err.first}); "
                             "keep one") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise RLHFInputError(f"{path}{line}: invalid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise RLHFInputError(f"{path}: expected a mapping of key: value lines at the top level")
    _YAML_KEY_LINES[str(path)] = _yaml_key_lines(text)
    return data


def build_config(cls: type[BaseConfig], raw: dict[str, Any], where: str = "config",
                 command_line: frozenset[str] = frozenset(), *, source: str | None = None,
                 section: str | None = None) -> BaseConfig:
    """Validate and type a raw mapping into ``cls``; every error names the key and where it was given: the
    command line for the keys in ``command_line``, else ``file:line [section]`` when the keys came from a
    YAML file ``source`` read by read_yaml, else ``where``."""
    written_as = {KEY_RENAMES[k][0]: k for k in raw if k in KEY_RENAMES}  # ours -> the file's name

    def where_of(key: str) -> str:
        key = written_as.get(key, key)
        if key in command_line:
            return "command line"
        return _key_where(source, section, key) if source else where

    values = _translate_keys(raw, cls, where_of)
    hints = _field_types(cls)
    typed = {k: _coerce(v, hints[k], k, where_of(k)) for k, v in values.items()}
    try:
        return cls(**typed)
    except RLHFInputError as error:  # a value check of the config: point at the key when the user gave it
        named = re.match(r"config field '([^']+)'", str(error))
        if named and named.group(1) in typed:
            raise RLHFInputError(f"{where_of(named.group(1))}: {error}") from None
        raise


def load_config(cls: type[BaseConfig], path: str | os.PathLike | None = None,
                overrides: Iterable[str] = ()) -> BaseConfig:
    """Read a stage config from YAML (optional) plus ``key=value`` overrides, LLaMA-Factory keys accepted."""
    raw = read_yaml(path) if path else {}
    given = parse_overrides(overrides)
    raw.update(given)
    return build_config(cls, raw, where=str(path) if path else "command line", command_line=frozenset(given),
                        source=str(path) if path else None)


def save_config(config: BaseConfig | PipelineConfig, path: str | os.PathLike) -> None:
    """Write a config back to YAML so a run can be repeated exactly."""

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False), encoding="utf-8")


def config_help(cls: type[BaseConfig]) -> str:
    """One line per field: name, type, default, help — for ``--help`` (docs/configuration.md is written from the
    same help)."""
    hints = _field_types(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        type_name = getattr(hints[f.name], "__name__", str(hints[f.name])).replace("typing.", "")
        rows.append(f"  {f.name:<28} {type_name:<11} default {default!r:<14} {f.metadata.get('help', '')}")
    return "\n".join(rows)


@dataclass
class PipelineConfig:
    """Several stages run in order. Top-level keys are shared by every stage; a section named after a
    stage (``sft:``) overrides them for that stage. Each stage writes to ``output_dir/<stage>`` and
    starts from the previous stage's model."""

    stages: list[str] = _opt(["sft"], "Stages to run, in order: training stages, then optionally eval, best_of_n, "
                                      "merge")
    output_dir: str = _opt("outputs/pipeline", "Root folder; stage N writes output_dir/<stage>, its log "
                                               "output_dir/logs/<stage>.log")
    shared: dict[str, Any] = _opt({}, "Keys applied to every stage")
    stage_overrides: dict[str, dict[str, Any]] = _opt({}, "Per-stage keys, overriding shared ones")
    capability_tests: dict[str, dict[str, Any]] = _opt({}, "Probe tasks run before and after each policy-optimisation "
                                                           "stage: {task: {dataset, dataset_dir?, max_samples?, "
                                                           "verifier?}}")
    capability_threshold: float = _opt(0.05, "Roll a stage back when a capability task's accuracy falls by more than "
                                             "this (absolute)")
    rollback_on_error: bool = _opt(True, "A stage that crashes or diverges is rolled back (recorded) and the pipeline "
                                         "goes on from the previous model; false: stop")
    final_stages: dict[str, dict[str, Any]] = _opt({}, "Options of the eval, best_of_n and merge stages (their YAML "
                                                       "sections)")
    source: str = _opt("config", "Where the config came from, for error messages")
    command_line: tuple[str, ...] = _opt((), "The keys given as key=value overrides (e.g. merge.density), for error "
                                             "messages")

    def __post_init__(self) -> None:
        for stage in self.stages:
            _check_choice(stage, (*STAGE_CONFIGS, *FINAL_STAGES), "stages")
        for stage in self.stage_overrides:
            _check_choice(stage, STAGE_CONFIGS, "stage section")
        for stage, options in self.final_stages.items():
            _check_choice(stage, FINAL_STAGES, "stage section")
            unknown = sorted(set(options) - set(FINAL_STAGE_OPTIONS[stage]))
            if unknown and stage != "merge":  # merge's other keys go to model_merging.MergeConfig, which checks them
                raise RLHFInputError(f"{self.source} [{stage}]: unknown key(s) {', '.join(unknown)}; valid: "
                                     f"{', '.join(FINAL_STAGE_OPTIONS[stage])}")
            self._check_final_stage_values(stage)
        _check(0 <= self.capability_threshold <= 1, "capability_threshold", "must be in [0, 1]")
        for stage in [*self.stage_overrides, *self.final_stages]:
            if stage not in self.stages:
                logger.warning("%s: section '%s' is not in stages [%s]; its settings are unused", self.source, stage,
                               ", ".join(self.stages))
        for stage in self.stages:  # fail before any training if a later stage's keys are wrong
            if stage in STAGE_CONFIGS:
                self.stage_config(stage)
        if "merge" in self.stages:
            self._check_merge_section()

    def _check_final_stage_values(self, stage: str) -> None:
        """Counts, temperature and scorers of the eval / best_of_n sections, before any stage runs."""
        options = self.final_stage_options(stage)

        def where(key: str) -> str:  # "command line: best_of_n.n" or "demo.yaml [best_of_n]: n"
            given = f"{stage}.{key}" in self.command_line
            return f"command line: {stage}.{key}" if given else f"{self.source} [{stage}]: {key}"

        for key, kind in FINAL_STAGE_NUMBERS.get(stage, {}).items():
            value = options[key]
            if value is None and FINAL_STAGE_OPTIONS[stage][key] is None:
                continue  # optional: the pipeline's own setting applies
            if kind == "temperature":
                if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                    raise RLHFInputError(f"{where(key)} must be a number above 0 (e.g. 1.0), got {value!r}")
                continue
            least = 1 if kind == "count" else 0  # a seed may be 0
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise RLHFInputError(f"{where(key)} must be a whole number of at least {least}, got {value!r}")
        if "use_vllm" in options:
            if not isinstance(options["use_vllm"], bool):
                raise RLHFInputError(f"{where('use_vllm')} must be true or false, got {options['use_vllm']!r}")

            if options["use_vllm"] and vllm_missing():
                raise RLHFInputError(f"{where('use_vllm')}: {vllm_missing()}")
        if "scorers" in options:
            scorers = options["scorers"]
            if not (isinstance(scorers, (list, tuple)) and scorers and set(scorers) <= {"rm", "vote"}):
                raise RLHFInputError(f"{where('scorers')} must be a non-empty list of rm and/or vote, got {scorers!r}")

    def _check_merge_section(self) -> None:
        """The merge section, checked by model_merging's own rules before anything runs: a typo there would
        otherwise surface after every training stage. The stage names stand in for the models they produce."""
        import model_merging

        options = self.final_stage_options("merge")
        models = options["models"] or [s for s in self.stages if s in POLICY_OPTIMISATION_STAGES]
        if not models:
            return  # nothing to merge: the stage reports that when its turn comes
        raw = {k: v for k, v in options.items() if k != "evaluate"}
        raw.update(models=models, output_dir=str(Path(self.output_dir) / "merge"), overwrite=True)
        given = [key.split(".", 1)[1] for key in self.command_line if key.startswith("merge.")]
        try:
            config = model_merging.MergeConfig.from_dict(raw, source=f"{self.source} [merge]", command_line=given)
        except model_merging.MergeError as err:
            raise RLHFInputError(str(err)) from None
        named = ([("models", m.model) for m in config.models]
                 + [("models.base", m.base) for m in config.models if m.base])
        for option, name in named + ([("base_model", config.base_model)] if config.base_model else []):
            where = "command line" if option.split(".")[0] in given else f"{self.source} [merge]"
            if name in STAGE_CONFIGS or name in FINAL_STAGES:
                if name not in self.stages:
                    raise RLHFInputError(f"{where}: {option} names stage '{name}', which is not in stages "
                                         f"[{', '.join(self.stages)}]; add the stage or name a model directory")
            elif not Path(name).exists():
                raise RLHFInputError(f"{where}: {option}: '{name}' is neither a stage of this pipeline nor a directory")

    def final_stage_options(self, stage: str) -> dict[str, Any]:
        """An eval / best_of_n / merge stage's options: its defaults, then its YAML section."""
        return {**FINAL_STAGE_OPTIONS[stage], **self.final_stages.get(stage, {})}

    def stage_config(self, stage: str, model_name_or_path: str | None = None) -> BaseConfig:
        """The typed config of one stage: shared keys, then the stage's own section."""
        raw = {**self.shared, **self.stage_overrides.get(stage, {})}
        raw["output_dir"] = str(Path(self.output_dir) / stage)
        raw.setdefault("logging_dir", str(Path(self.output_dir) / "logs"))
        if model_name_or_path is not None:
            raw["model_name_or_path"] = model_name_or_path
        for key, stage_name in (("reward_model", "rm"), ("process_reward_model", "prm"), ("value_model", "rm")):
            if raw.get(key) == stage_name:  # the model trained by this pipeline's rm / prm stage
                raw[key] = str(Path(self.output_dir) / stage_name)
        if raw.get("ewc_lambda") and not raw.get("ewc_dataset") and "sft" in self.stages:
            # protect SFT
            raw["ewc_dataset"] = {**self.shared, **self.stage_overrides.get("sft", {})}.get("dataset", "")
        given = {key.split(".", 1)[-1] for key in self.command_line if "." not in key or key.startswith(f"{stage}.")}
        return build_config(STAGE_CONFIGS[stage], raw, where=f"{self.source} [{stage}]", command_line=frozenset(given),
                            source=self.source, section=stage)

    def to_dict(self) -> dict[str, Any]:
        return {"stages": list(self.stages), "output_dir": self.output_dir, **self.shared,
                **{stage: dict(keys) for stage, keys in self.stage_overrides.items()},
                **({"capability_tests": self.capability_tests} if self.capability_tests else {}),
                "capability_threshold": self.capability_threshold, "rollback_on_error": self.rollback_on_error,
                **{stage: dict(options) for stage, options in self.final_stages.items()}}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config", command_line: Iterable[str] = ()) -> PipelineConfig:
        raw = dict(raw)
        stages = raw.pop("stages", ["sft"])
        if isinstance(stages, str):
            stages = [s.strip() for s in stages.split(",") if s.strip()]
        output_dir = str(raw.pop("output_dir", "outputs/pipeline"))
        for key, value in raw.items():
            if key in (*STAGE_CONFIGS, *FINAL_STAGES) and not isinstance(value, dict):
                raise RLHFInputError(f"{source}: section '{key}' must be a mapping of key: value lines (indented "
                                     f"under '{key}:'), not {value!r}")
            near = difflib.get_close_matches(key, (*STAGE_CONFIGS, *FINAL_STAGES), n=1, cutoff=0.6)
            if isinstance(value, dict) and key not in (*STAGE_CONFIGS, *FINAL_STAGES, "capability_tests") and near:
                raise RLHFInputError(f"{source}: unknown section '{key}'; did you mean '{near[0]}'?")
        sections = {k: raw.pop(k) for k in list(raw) if k in STAGE_CONFIGS and isinstance(raw[k], dict)}
        finals = {k: raw.pop(k) for k in list(raw) if k in FINAL_STAGES and isinstance(raw[k], dict)}
        for key in list(raw):  # dotted overrides: sft.learning_rate=1e-3, best_of_n.n=4
            prefix = key.split(".", 1)[0]
            if "." in key and prefix in STAGE_CONFIGS:
                sections.setdefault(prefix, {})[key.split(".", 1)[1]] = raw.pop(key)
            elif "." in key and prefix in FINAL_STAGES:
                finals.setdefault(prefix, {})[key.split(".", 1)[1]] = raw.pop(key)
        for stage, keys in sections.items():  # the pipeline chains stages through output_dir/<stage>
            if "output_dir" in keys:
                raise RLHFInputError(f"{source}: '{stage}.output_dir' cannot be set in a pipeline: each stage writes "
                                     f"to the pipeline's output_dir/{stage}, where the next stage reads it; set the "
                                     "pipeline's output_dir instead, or run the stage alone (python rlhf.py "
                                     f"{stage} --config ...)")
        gates = {key: raw.pop(key) for key in ("capability_tests", "capability_threshold", "rollback_on_error")
                 if key in raw}
        if not isinstance(gates.get("capability_tests", {}), dict):
            raise RLHFInputError(f"{source}: 'capability_tests' maps task names to {{dataset, max_samples, verifier}}")
        gate_types = {"capability_threshold": float, "rollback_on_error": bool}
        return cls(stages=stages, output_dir=output_dir, shared=raw, stage_overrides=sections, final_stages=finals,
                   source=source, command_line=tuple(command_line),
                   **{k: _coerce(v, gate_types.get(k, dict), k, source) for k, v in gates.items()})

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: Iterable[str] = (), preset: str | None = None) -> PipelineConfig:
        """The YAML file, on top of a 7B/70B ``preset`` if named (the file's stage sections add to the
        preset's), then key=value overrides."""
        raw = read_yaml(path)
        if preset is not None:
            _check_choice(preset, PRESET_ARCHITECTURES, "--preset")
            base = (get_7b_model_config if preset == "7b" else get_70b_model_config)().to_dict()
            raw = {**base, **raw, **{stage: {**base[stage], **raw.get(stage, {})} for stage in base
                                     if isinstance(base[stage], dict) and isinstance(raw.get(stage, {}), dict)}}
        given = parse_overrides(overrides)
        raw.update(given)
        return cls.from_dict(raw, source=str(path) + (f" on the {preset} preset" if preset else ""), command_line=given)


# -- presets for real models and the memory plan ----------------------------------------------------------------

PRESET_ARCHITECTURES: dict[str, dict[str, Any]] = {
    # Qwen2.5-7B-Instruct and Llama-3.1-70B-Instruct, from their config.json files
    "7b": {"model": "Qwen/Qwen2.5-7B-Instruct", "vocab_size": 152064, "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "tie_word_embeddings": False},
    "70b": {"model": "meta-llama/Llama-3.1-70B-Instruct", "vocab_size": 128256, "hidden_size": 8192,
            "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "tie_word_embeddings": False},
}


def _preset(size: str, finetuning_type: str, model_name_or_path: str | None, *, batch: int, accumulation: int,
            lora_rank: int, learning_rate: float) -> PipelineConfig:
    arch = PRESET_ARCHITECTURES[size]
    _check_choice(finetuning_type, ("lora", "full"), "finetuning_type")
    shared = {"model_name_or_path": model_name_or_path or arch["model"], "template": "auto",
              "finetuning_type": finetuning_type, "lora_rank": lora_rank, "lora_alpha": 2 * lora_rank,
              "lora_target": "all", "bf16": True, "gradient_checkpointing": True,
              "attn_implementation": "auto",  # flash_attention_2 where installed on the GPU, else sdpa
              "cutoff_len": 2048, "per_device_train_batch_size": batch, "gradient_accumulation_steps": accumulation,
              "learning_rate": learning_rate, "lr_scheduler_type": "cosine", "warmup_ratio": 0.03,
              "logging_steps": 10, "save_steps": 500, "save_total_limit": 2, "plot_loss": True}
    stages = {"sft": {"num_train_epochs": 2.0},
              "rm": {"learning_rate": learning_rate / 2, "num_train_epochs": 1.0},
              "dpo": {"pref_beta": 0.1, "learning_rate": learning_rate / 10, "num_train_epochs": 1.0},
              "grpo": {"num_generations": 8, "learning_rate": learning_rate / 20, "max_steps": 500,
                       "per_device_train_batch_size": max(batch, 8), "reward_model": "rm"}}  # this pipeline's rm
    return PipelineConfig(stages=list(stages), output_dir=f"outputs/{size}", shared=shared, stage_overrides=stages,
                          source=f"get_{size}_model_config()")


def get_7b_model_config(finetuning_type: str = "lora", model_name_or_path: str | None = None) -> PipelineConfig:
    """SFT -> RM -> DPO -> GRPO for a 7B model (Qwen2.5-7B-Instruct unless named): bf16, gradient
    checkpointing, flash-attn 2 where available, LoRA rank 16 on every linear layer (or full), 4 x 8
    sequences of 2048 tokens per optimizer step per GPU. LoRA fits one 80 GB GPU; full fine-tuning
    needs ZeRO-3 or FSDP across 8 (``python rlhf.py plan --preset 7b --gpus 8 --finetuning-type full``;
    configs/accelerate/)."""
    return _preset("7b", finetuning_type, model_name_or_path, batch=4, accumulation=8, lora_rank=16,
                   learning_rate=1e-4 if finetuning_type == "lora" else 1e-5)


def get_70b_model_config(finetuning_type: str = "lora", model_name_or_path: str | None = None) -> PipelineConfig:
    """The same pipeline for a 70B model (Llama-3.1-70B-Instruct unless named): LoRA rank 16 (or full),
    1 x 32 sequences per optimizer step per GPU, bf16, gradient checkpointing, ZeRO-3 or FSDP across
    8 GPUs (configs/accelerate/); check the fit with ``python rlhf.py plan --preset 70b --gpus 8``."""
    return _preset("70b", finetuning_type, model_name_or_path, batch=1, accumulation=32, lora_rank=16,
                   learning_rate=5e-5 if finetuning_type == "lora" else 5e-6)


def count_parameters(arch: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen-style decoder from its config: embeddings (and an untied LM head),
    per layer q/o (h x h), k/v (h x kv_heads x head_dim), a gated MLP (3 x h x intermediate) and two
    norms, plus the final norm (attention biases are ignored: < 0.01%); plus a vision-language model's
    vision tower and projector (``vision_parameters``, counted from the model, see ``model_architecture``)."""
    h, layers, vocab = arch["hidden_size"], arch["num_hidden_layers"], arch["vocab_size"]
    kv_dim = arch["num_key_value_heads"] * (h // arch["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * arch["intermediate_size"] + 2 * h
    return (vocab * h * (1 if arch.get("tie_word_embeddings") else 2) + layers * per_layer + h
            + arch.get("vision_parameters", 0))


def model_architecture(path: str) -> dict[str, Any]:
    """The ``plan`` architecture of a model directory (or hub id): its language model's sizes, and for a
    vision-language model the parameters of everything outside the language model (vision tower, projector),
    counted on the meta device (no weights are read)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise RLHFInputError(f"plan --model {path}: cannot read its config.json ({_one_line(err)})") from None
    text = config.get_text_config()
    arch = {"model": path, **{key: getattr(text, key) for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                                 "num_hidden_layers", "num_attention_heads")},
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))}
    if getattr(config, "vision_config", None) is not None:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
        arch["vision_parameters"] = sum(p.numel() for n, p in model.named_parameters()
                                        if not any(key in n for key in LANGUAGE_MODEL_KEYS))
    return arch


def count_lora_parameters(arch: dict[str, Any], rank: int) -> int:
    """LoRA on every linear layer of every block: r x (in + out) per projection."""
    h, inter = arch["hidden_size"], arch["intermediate_size"]
    kv_dim = arch["num_key_value_heads"] * (h // arch["num_attention_heads"])
    per_layer = rank * ((h + h) * 2 + (h + kv_dim) * 2 + (h + inter) * 3)
    return arch["num_hidden_layers"] * per_layer


GIB = 1024 ** 3


def estimate_memory(arch: dict[str, Any], *, gpus: int = 1, finetuning_type: str = "lora", lora_rank: int = 16,
                    batch: int = 1, seq_len: int = 2048, gradient_checkpointing: bool = True, sharded: bool = True,
                    stage: str = "grpo") -> dict[str, float]:
    """Per-GPU memory in GiB of one training step, by the usual mixed-precision accounting:
    - weights: bf16, 2 bytes per parameter;
    - gradients: bf16, 2 bytes per trainable parameter;
    - optimizer: AdamW with fp32 master weights and two fp32 moments, 12 bytes per trainable parameter;
    - activations: with gradient checkpointing, each layer's bf16 input (2 x b x s x h bytes) plus one
      layer recomputed in full; without it every layer in full. A full layer is Korthikanti et al.'s
      (2022) s x b x h x (34 + 5 x heads x s / h) bytes; the fp32 logits (4 x b x s x V) come on top;
    - reference model: a frozen bf16 copy for dpo / grpo / ppo with full fine-tuning (LoRA switches
      its adapter off instead: no copy);
    - reward model: a frozen bf16 copy for grpo / ppo (a learned reward), ppo also a critic trained
      like the policy;
    - rm and dpo run each pair's two sequences in one forward (twice the activations).

    ``sharded`` (ZeRO-3 / FSDP full shard) divides weights, gradients, optimizer states and the frozen
    copies by ``gpus``; activations are per GPU. Excluded: CUDA context and allocator fragmentation
    (budget 1-3 GiB) and the generation KV cache of online stages."""
    params = count_parameters(arch)  # the vision tower and projector stay frozen (their defaults): weights only
    trainable = (params - arch.get("vision_parameters", 0) if finetuning_type == "full"
                 else count_lora_parameters(arch, lora_rank))
    share = gpus if sharded else 1
    h, layers, heads, vocab = (arch["hidden_size"], arch["num_hidden_layers"], arch["num_attention_heads"],
                               arch["vocab_size"])
    full_layer = seq_len * batch * h * (34 + 5 * heads * seq_len / h)
    stored = layers * 2 * batch * seq_len * h + full_layer if gradient_checkpointing else layers * full_layer
    frozen = 2 * params / share
    critic = stage == "ppo"
    if stage in ("rm", "dpo"):  # a preference pair is two sequences (chosen, rejected) in one forward
        stored *= 2
    plan = {"weights": 2 * params / share, "gradients": 2 * trainable * (2 if critic else 1) / share,
            "optimizer": 12 * trainable * (2 if critic else 1) / share,
            "activations": (stored + 4 * batch * seq_len * vocab * (2 if stage in ("rm", "dpo") else 1))
            * (2 if critic else 1),
            "reference model": frozen if stage in ("dpo", "grpo", "ppo") and finetuning_type == "full" else 0.0,
            "reward model": frozen * (2 if critic else 1) if stage in ("grpo", "ppo") else 0.0}
    plan = {k: v / GIB for k, v in plan.items()}
    plan["total"] = sum(plan.values())
    return plan


# ==== 2. Infrastructure ====


def _launch_rank() -> int:
    """This process's rank under a multi-process launch (torchrun and ``accelerate launch`` set RANK), else 0.
    Readable before any DeviceManager exists, for what only one process should do (report, console)."""
    return int(os.environ.get("RANK", "0"))


def rich_console(**kwargs: Any) -> Any:
    """A rich Console. Written to a file or a CI log (no terminal width to fit, no COLUMNS), it is 160 columns
    wide instead of rich's 80, so summary tables keep a row on one line and the output column is not cut."""
    from rich.console import Console

    console = Console(**kwargs)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 160
    return console


def setup_logging(level: str | int = "INFO", log_file: str | os.PathLike | None = None) -> logging.Logger:
    """Rich console logging for the ``rlhf`` logger, plus an optional plain-text file. It configures the process
    (as a script's first line would); the stage runners call it inside :func:`logging_restored`, so their console
    handler and log file last as long as the run."""
    from rich.logging import RichHandler

    root = logging.getLogger("rlhf")
    if _launch_rank() > 0:  # the other processes of a multi-process launch: warnings, not every line twice
        level = max(logging.getLevelName(level) if isinstance(level, str) else level, logging.WARNING)
    root.setLevel(level)
    if not any(isinstance(h, RichHandler) for h in root.handlers):
        handler = RichHandler(console=rich_console(), show_path=False, rich_tracebacks=False, markup=False,
                              log_time_format="[%X]")
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    if log_file is not None:
        path = Path(log_file).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in [h for h in root.handlers if isinstance(h, logging.FileHandler) and Path(h.baseFilename) != path]:
            root.removeHandler(old)  # one run, one log file: an earlier run's file must not receive this run
            old.close()
        if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in root.handlers):
            file_handler = logging.FileHandler(path, encoding="utf-8")
            file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            root.addHandler(file_handler)
    root.propagate = False
    _quiet_library_progress_bars()
    return root


def _quiet_library_progress_bars() -> None:
    """transformers and datasets print tqdm bars for every save/load/map; our rich bar and log lines
    already say what is happening, so theirs only clutter the console."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.disable_progress_bar()


@contextlib.contextmanager
def logging_restored() -> Iterator[None]:
    """Put the ``rlhf`` logger (level, propagation, handlers) and the progress-bar switches of transformers and
    datasets back as they were, when the block ends. Every stage runner, the orchestrator and ``main`` run inside
    it: ``setup_logging`` configures the console and the run's log file for the length of one run, and a caller's
    own logging is as it was afterwards (a later message never lands in an earlier run's log file)."""
    import datasets
    import transformers

    log = logging.getLogger("rlhf")
    level, propagate, handlers = log.level, log.propagate, list(log.handlers)
    bars = transformers.utils.logging.is_progress_bar_enabled(), datasets.utils.logging.is_progress_bar_enabled()
    try:
        yield
    finally:
        for handler in list(log.handlers):
            log.removeHandler(handler)
            if handler not in handlers:
                handler.close()
        for handler in handlers:  # in their order; a file handler closed meanwhile reopens its file for appending
            log.addHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
        for module, enabled in zip((transformers, datasets), bars):
            (module.utils.logging.enable_progress_bar if enabled else module.utils.logging.disable_progress_bar)()


def _leaves_logging_as_found(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` inside :func:`logging_restored`."""
    @functools.wraps(run)
    def call(*args: Any, **kwargs: Any) -> Any:
        with logging_restored():
            return run(*args, **kwargs)

    return call


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (all devices) so a run is repeatable."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def parameter_numel(param: nn.Parameter) -> int:
    """A parameter's size, also when DeepSpeed built it partitioned (its ``ds_numel`` is the whole one's)."""
    return getattr(param, "ds_numel", param.numel())


def weight_sharding(model: nn.Module) -> str:
    """How a model prepared by accelerate splits its weights across processes: ``fsdp1`` (the FSDP v1
    wrapper), ``fsdp2`` (``fully_shard``, applied in place), ``zero3`` (DeepSpeed ZeRO-3 partitioned
    parameters) or '' (every process holds them whole: one process, DDP, ZeRO-1/2)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    modules = list(model.modules())
    if any(isinstance(m, FullyShardedDataParallel) for m in modules):
        return "fsdp1"
    if any(isinstance(m, FSDPModule) for m in modules):
        return "fsdp2"
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3 marks the parameters it partitions
        return "zero3"
    return ""


class GatherMeter:
    """The bytes of gathered tensors still alive during a sharded weight sync, and their peak: a sync gathers one
    tensor (FSDP2) or one module (ZeRO-3) at a time and its consumer frees each once sent, so the peak is what a
    sync costs on top of the shards (a layer's worth, not the model)."""

    def __init__(self) -> None:
        self.live = self.peak = self.total = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.total += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, size)
        return tensor

    def _freed(self, size: int) -> None:
        self.live -= size


def gathered_named_tensors(model: nn.Module, kind: str, wanted: Callable[[str], bool] | None = None,
                           meter: GatherMeter | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A sharded model's weights (``kind``: ``weight_sharding``) under their unsharded names, each gathered whole
    when asked: FSDP2 a tensor at a time (``DTensor.full_tensor``), ZeRO-3 a module's own parameters at a time
    (``GatheredParameters``, copied out, since DeepSpeed frees the gathered storage on leaving). Tied weights come
    once; ``wanted(name)`` picks which (e.g. a LoRA adapter's). Every process must iterate it to the end in the same
    order, since each gather is a collective: a consumer that stops early (an error) has the rest gathered and
    dropped when the generator closes, so the other processes are not left waiting."""
    wanted = wanted or (lambda name: True)
    if kind == "zero3":
        yield from _zero3_named_tensors(model, wanted, meter)
        return
    from torch.distributed.tensor import DTensor

    plan = _fsdp2_plan(model, wanted)
    done = 0
    try:
        for name, tensor in plan:
            done += 1
            if isinstance(tensor, DTensor):
                full = tensor.full_tensor().detach()
                yield name, (meter.track(full) if meter is not None else full)
                del full  # before the next gather, so that one gathered tensor is held here at a time
            else:
                yield name, tensor.detach()
    finally:  # closed early: the other processes still gather the rest
        for _, tensor in plan[done:]:
            if isinstance(tensor, DTensor):
                tensor.full_tensor()


def _fsdp2_plan(model: nn.Module, wanted: Callable[[str], bool]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs an FSDP2 model's gather goes through, tied ones once: the same on every process, so
    the gathers pair up."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    plan = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = local.data_ptr() if local.numel() else id(tensor)
        if key not in seen and wanted(name):
            plan.append((name, tensor))
        seen.add(key)
    return plan


def _zero3_plan(model: nn.Module, wanted: Callable[[str], bool]) -> list[list[tuple[str, nn.Parameter]]]:
    """A ZeRO-3 model's parameters grouped by the module that owns them (each group gathered at once), tied ones
    once: the same on every process."""
    seen: set[int] = set()
    plan = []
    for prefix, module in model.named_modules():
        params = [(f"{prefix}.{name}" if prefix else name, p) for name, p in module.named_parameters(recurse=False)
                  if id(p) not in seen]
        seen.update(id(p) for _, p in params)
        params = [(name, p) for name, p in params if wanted(name)]
        if params:
            plan.append(params)
    return plan


def sharded_layout(model: nn.Module, kind: str, wanted: Callable[[str], bool] | None = None
                   ) -> list[tuple[str, str, list[int]]]:
    """The names, dtypes and whole shapes ``gathered_named_tensors`` yields, in its order, without gathering."""
    wanted = wanted or (lambda name: True)
    if kind == "zero3":
        return [(name, str(p.dtype).removeprefix("torch."), list(p.ds_shape))
                for params in _zero3_plan(model, wanted) for name, p in params]
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in _fsdp2_plan(model, wanted)]


def _zero3_named_tensors(model: nn.Module, wanted: Callable[[str], bool],
                         meter: GatherMeter | None) -> Iterator[tuple[str, torch.Tensor]]:
    import deepspeed

    plan = _zero3_plan(model, wanted)
    done = 0
    try:
        for params in plan:
            done += 1
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                copies = [(name, p.data.detach().clone()) for name, p in params]
            for name, tensor in copies:
                yield name, (meter.track(tensor) if meter is not None else tensor)
            del copies
    finally:
        for params in plan[done:]:
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                pass


def _set_deepspeed_partition(param: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """This process's part of DeepSpeed's float32 copy of ``param`` (``key`` None) or of its optimizer state ``key``,
    from the whole ``value``. ZeRO-3 pads a parameter to a multiple of the processes, and its own
    ``safe_set_full_*`` slices past the end of a parameter smaller than that (a bias of 1): the slice is taken here,
    through two of ZeRO-3's private methods (tests/test_sharded.py checks them where DeepSpeed is installed)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    flat = value.flatten()
    if not hasattr(param, "ds_id"):  # ZeRO-1/2: DeepSpeed maps the fragments itself
        if key is None:
            safe_set_full_fp32_param(param, flat)
        else:
            safe_set_full_optimizer_state(param, flat, key)
        return
    zero = param._z3_optimizer
    part, _ = zero._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    start = part.numel() * zero._get_param_partition_rank(param)
    mine = flat[start:start + part.numel()]
    part.data.zero_()
    part.data[:mine.numel()].copy_(mine)


def _link_zero12_fragments(zero: Any) -> None:
    """ZeRO-1/2 let each parameter read its optimizer state through views linked once, after its first step; with
    several param groups that link runs when only the first group has stepped, leaving the others' views empty
    (DeepSpeed 0.19.8). Linked again here, from the state as it is (ZeRO-3 reads the state directly)."""
    if not hasattr(zero, "single_partition_of_fp32_groups"):
        return
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for index, flat in enumerate(zero.single_partition_of_fp32_groups):
        lazy_init_hp_params_optimizer_state(zero.bit16_groups[index], flat, zero.optimizer.state)


class DeepSpeedSupport:
    """DeepSpeed under a DeviceManager (its ``deepspeed``): the model and its optimizer made one engine, which steps,
    clips and partitions them itself (``prepare_engine``); the model a stage trains built partitioned under ZeRO-3
    (``zero3_init``); and DeepSpeed's state, whose optimizer keeps float32 weights and moments in flat partitions of
    its own, read and written a parameter at a time through deepspeed.utils' safe_get/safe_set functions (ZeRO
    stages 1 to 3). Only ``zero3_init`` and ``sync_master_weights`` may be called without DeepSpeed: they do
    nothing then."""

    def __init__(self, devices: DeviceManager) -> None:
        self.devices = devices
        self.engine: Any = None  # the engine training now (a pipeline's stages each make one: prepare_engine)
        self._as_given: dict[str, Any] | None = None  # the keys KEYS_FROM_CONFIG fills, as the launch gave them
        self._groups: list[list[int]] = []  # which parameters each optimizer group holds (ids)
        # accelerate's ``zero3_init_flag`` (on by default at ZeRO stage 3) makes every later ``from_pretrained`` in
        # the process build its model partitioned (DeepSpeed's zero.Init), through a reference transformers keeps.
        # Such a model works only inside a DeepSpeed engine, and building it is a collective of every process: a
        # reference copy, an evaluator, or a model the main process loads alone would break or hang. So the reference
        # is held here and applied only where a stage loads the model it is about to train (``zero3_init``).
        self._zero3_init_config = None
        if self.devices.uses_deepspeed:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            # accelerate keeps the object alive on its (process-wide) plugin; a later DeviceManager finds it there
            self._zero3_init_config = getattr(self.devices.accelerator.state.deepspeed_plugin, "dschf", None)
            unset_hf_deepspeed_config()

    @contextlib.contextmanager
    def zero3_init(self) -> Iterator[None]:
        """Around loading the model a stage trains: under DeepSpeed with ``zero3_init_flag`` it is built partitioned
        (a 70B model never sits whole in one process); otherwise nothing."""
        if getattr(self, "_zero3_init_config", None) is None:
            yield
            return
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        set_hf_deepspeed_config(self._zero3_init_config)
        try:
            yield
        finally:
            unset_hf_deepspeed_config()

    # DeepSpeed config keys the trainers decide, from the rlhf config field beside each
    KEYS_FROM_CONFIG = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
                        "gradient_accumulation_steps": "gradient_accumulation_steps",
                        "gradient_clipping": "max_grad_norm"}

    def prepare_engine(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: BaseConfig
                       ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """``model`` and ``optimizer`` made one DeepSpeed engine by accelerate (its DeepSpeed ``prepare`` takes both in
        one call). The trainers accumulate over micro-batches themselves and mark the last one (``no_sync``), so
        DeepSpeed is told to accumulate 1 and steps once per optimizer step (``DeviceManager.deepspeed_step``); it
        clips at ``max_grad_norm``. A DeepSpeed config that sets these otherwise, or brings its own optimizer or
        schedule (the trainers build them from ``optim``, ``learning_rate`` and ``lr_scheduler_type``), is refused."""
        ds_config = self.devices.accelerator.state.deepspeed_plugin.deepspeed_config
        if self._as_given is None:  # as the launch gave it: a pipeline's stages each fill it in
            self._as_given = {key: ds_config.get(key, "auto") for key in [*self.KEYS_FROM_CONFIG, "train_batch_size"]}
        given = self._as_given
        for key in ("optimizer", "scheduler"):
            if key in ds_config:
                raise RLHFInputError(f"DeepSpeed config: remove '{key}'; the trainers build the optimizer and its "
                                     f"schedule from the rlhf config (optim, learning_rate, lr_scheduler_type)")
        for key, config_field in self.KEYS_FROM_CONFIG.items():
            ours, theirs = getattr(config, config_field), given[key]
            # accelerate writes gradient_accumulation_steps: 1 into a config file that leaves it out
            if theirs not in ("auto", ours) and not (key == "gradient_accumulation_steps" and theirs == 1):
                raise RLHFInputError(f"DeepSpeed config key '{key}' is {theirs!r}, but the rlhf config's "
                                     f"'{config_field}' is {ours!r}: the trainers take it from '{config_field}'; set "
                                     f"'{key}' to \"auto\"")
        micro_batch = config.per_device_train_batch_size
        whole_batch = micro_batch * config.gradient_accumulation_steps * self.devices.num_processes
        if given["train_batch_size"] not in ("auto", whole_batch):
            raise RLHFInputError(f"DeepSpeed config key 'train_batch_size' is {given['train_batch_size']!r}, but "
                                 f"per_device_train_batch_size x gradient_accumulation_steps x processes is "
                                 f"{whole_batch}; set it to \"auto\"")
        ds_config.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1,
                         train_batch_size=micro_batch * self.devices.num_processes,
                         gradient_clipping=float(max(config.max_grad_norm, 0.0)))
        # which parameters each group holds, for a checkpoint's optimizer state (DeepSpeed swaps them for flat ones)
        self._groups = [[id(p) for p in group["params"]] for group in optimizer.param_groups]
        accelerator = self.devices.accelerator
        accelerator.deepspeed_engine_wrapped = None  # accelerate keeps the first engine it made: a later stage's
        model, optimizer = accelerator.prepare(model, optimizer)
        self.engine = model
        return model, optimizer

    def optimizer_state(self, module: nn.Module) -> dict[str, Any] | None:
        """DeepSpeed's optimizer state keyed by parameter name, each parameter's moments whole, on the main process
        (None on the others): the layout ``full_optimizer_state`` gives for FSDP2. Every process must call it (under
        ZeRO-3 each parameter's moments are gathered from the processes in turn)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        zero = self.engine.optimizer
        base = zero.optimizer  # the torch optimizer over DeepSpeed's flat float32 partitions
        flat_state = next((entry for entry in base.state.values() if entry), {})  # empty before the first step
        _link_zero12_fragments(zero)
        moments = [key for key, value in flat_state.items() if torch.is_tensor(value) and value.dim() > 0]
        state: dict[str, dict[str, Any]] = {}
        for name, param in module.named_parameters():
            if not param.requires_grad or not moments:
                continue
            entry = {key: safe_get_full_optimizer_state(param, key) for key in moments}
            if self.devices.is_main_process:
                shape = tuple(getattr(param, "ds_shape", param.shape))
                state[name] = {key: value.detach().reshape(shape).cpu() for key, value in entry.items()}
                state[name].update({key: value.detach().cpu().clone() if torch.is_tensor(value) else value
                                    for key, value in flat_state.items() if key not in moments})
        if not self.devices.is_main_process:
            return None
        names = {id(param): name for name, param in module.named_parameters()}
        groups = [{**{key: value for key, value in group.items() if key != "params"},  # lr as the schedule left it
                   "params": [names[pid] for pid in self._groups[index] if pid in names]}
                  for index, group in enumerate(base.param_groups)]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        """Set DeepSpeed's moments (and step) from a state keyed by parameter name; each process keeps its
        partition. AdamW creates its state at its first step: before it, the state is created here as AdamW would."""
        zero = self.engine.optimizer
        base = zero.optimizer
        for group, saved in zip(base.param_groups, state["param_groups"]):  # lr, weight decay, betas
            group.update({key: value for key, value in saved.items() if key != "params"})
        entries = state["state"]
        if not entries:
            return
        first = next(iter(entries.values()))
        moments = [key for key, value in first.items() if torch.is_tensor(value) and value.dim() > 0]
        # the flat float32 partitions the moments belong to (ZeRO-3 lists them in the param groups only while it steps)
        flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        on_device = any(group.get("fused") or group.get("capturable") for group in base.param_groups)
        for flat in flats:
            if not base.state[flat]:
                base.state[flat] = {key: torch.zeros_like(flat) for key in moments}
            for key, value in first.items():
                if key not in moments:  # the step count, one for every parameter
                    base.state[flat][key] = (torch.as_tensor(value, dtype=torch.float32,
                                                             device=flat.device if on_device else "cpu").clone()
                                             if torch.is_tensor(value) else value)
        _link_zero12_fragments(zero)
        params = dict(module.named_parameters())
        for name, entry in entries.items():
            if name in params and params[name].requires_grad:
                for key in moments:
                    _set_deepspeed_partition(params[name], entry[key].to(self.devices.device), key)

    def load_zero3_weights(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Whole weights into a ZeRO-3 model, a module's parameters at a time (the main process's copy is partitioned
        to every process), and into DeepSpeed's float32 copy of them, which its optimizer steps from."""
        import deepspeed

        for params in _zero3_plan(module, lambda name: name in state):
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                if self.devices.is_main_process:
                    for name, param in params:
                        param.data.copy_(state[name].reshape(param.shape))
        self.sync_master_weights(module, state)

    def sync_master_weights(self, module: nn.Module, state: dict[str, torch.Tensor] | None = None) -> None:
        """Under DeepSpeed: its float32 copy of the trainable weights set from ``state`` (the module's own weights
        when None, for ZeRO-1/2, where every process holds them whole), after the weights were loaded."""
        if not self.devices.uses_deepspeed:
            return
        for name, param in module.named_parameters():
            if param.requires_grad:
                value = state[name] if state is not None and name in state else param.data
                _set_deepspeed_partition(param, value.to(self.devices.device, torch.float32), None)


class DeviceManager:
    """Device, mixed precision, gradient scaling, clipping and process layout, over ``accelerate``.

    Training code talks to this class, never to CUDA or torch.distributed directly, so the same loop
    runs on a laptop CPU, one GPU, or many GPUs under ``accelerate launch`` (DDP, FSDP, DeepSpeed).
    """

    def __init__(self, mixed_precision: str = "no", log_with: list[str] | None = None,
                 project_dir: str | os.PathLike | None = None, ddp_timeout: int = 1800) -> None:
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        kwargs = dict(mixed_precision=mixed_precision, log_with=log_with or None,
                      project_dir=str(project_dir) if project_dir else None,
                      kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout))])
        try:
            self.accelerator = Accelerator(**kwargs)
        except ValueError:
            # accelerate keeps one process-wide state; a second run in the same single process
            # (tests, notebooks) may ask for a different precision, which is safe to reset.
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            self.accelerator = Accelerator(**kwargs)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and self.accelerator.num_processes == 1:
            # launched as several processes, but accelerate found no device backend for them (`accelerate launch
            # --multi_gpu` on a machine without GPUs; `--cpu` starts one process only): each would train alone as
            # rank 0 of 1, all writing the same output_dir. CPU processes can train together over gloo.
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":  # cpu=True would drop DeepSpeed
                kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo",
                                                                    timeout=timedelta(seconds=ddp_timeout))]
                self.accelerator = Accelerator(**kwargs)
            else:
                self.accelerator = Accelerator(cpu=True, **kwargs)
        self.deepspeed = DeepSpeedSupport(self)  # holds zero3_init_flag's reference from here on

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def process_index(self) -> int:
        return self.accelerator.process_index

    def prepare(self, *objects: Any) -> Any:
        return self.accelerator.prepare(*objects)

    # -- DeepSpeed: the model and its optimizer are one engine, which steps, clips and partitions them itself
    @property
    def uses_deepspeed(self) -> bool:
        return self.accelerator.distributed_type == "DEEPSPEED"

    def zero3_init(self) -> contextlib.AbstractContextManager:
        """Around loading the model a stage trains (``DeepSpeedSupport.zero3_init``)."""
        return self.deepspeed.zero3_init()

    def prepare_engine(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: BaseConfig
                       ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """``model`` and ``optimizer`` made one DeepSpeed engine (``DeepSpeedSupport.prepare_engine``)."""
        return self.deepspeed.prepare_engine(model, optimizer, config)

    def deepspeed_step(self) -> float:
        """DeepSpeed's optimizer step (clip, check, update, zero the gradients); the gradient norm before clipping,
        inf when it was not finite and DeepSpeed skipped the update."""
        engine = self.deepspeed.engine
        engine.step()
        norm = engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the accumulated gradients: under DeepSpeed its partitioned ones (accelerate's wrapper makes the
        optimizer's own ``zero_grad`` a no-op there, since the engine zeroes them in its step)."""
        if self.uses_deepspeed:
            self.deepspeed.engine.optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.zero_grad(set_to_none=True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model)

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.accelerator.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        if self.uses_deepspeed:  # accelerate's backward would also step DeepSpeed's optimizer: ours is deepspeed_step
            self.deepspeed.engine.backward(loss)
            return
        self.accelerator.backward(loss)  # applies the fp16 loss scale when active

    def clip_grad_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> float:
        """Unscale (fp16) and clip; returns the total norm before clipping (inf/nan if overflowed)."""
        parameters = [p for p in parameters if p.grad is not None]
        if not parameters:
            return 0.0
        if max_norm <= 0:
            return float(torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in parameters])))
        return float(self.accelerator.clip_grad_norm_(parameters, max_norm))

    def no_sync(self, model: nn.Module, skip: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on micro-batches that are not the last of an accumulation (around the
        forward). DeepSpeed reduces its partitioned gradients itself and is told where the accumulation ends."""
        if self.uses_deepspeed:
            self.deepspeed.engine.set_gradient_accumulation_boundary(not skip)
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model) if skip and self.num_processes > 1 else contextlib.nullcontext()

    def sum_across_processes(self, value: float | int) -> float:
        if self.num_processes == 1:
            return float(value)
        tensor = torch.tensor(float(value), device=self.device)
        return float(self.accelerator.reduce(tensor, reduction="sum"))

    def sum_list_across_processes(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over processes, in one collective (float64, so token counts stay exact)."""
        if self.num_processes == 1:
            return [float(v) for v in values]
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        return self.accelerator.reduce(tensor, reduction="sum").tolist()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` (the same shape on each) concatenated along dim 0 in rank order,
        on the device ``tensor`` came from. Shapes: (N, ...) -> (num_processes * N, ...)."""
        if self.num_processes == 1:
            return tensor
        return self.accelerator.gather(tensor.contiguous().to(self.device)).to(tensor.device)

    def gather_object(self, value: Any) -> list[Any]:
        """Every process's ``value`` in rank order (``[value]`` on one process). The transport pickles in
        memory between our own processes; nothing is written."""
        if self.num_processes == 1:
            return [value]
        from accelerate.utils import gather_object

        return gather_object([value])

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def broadcast_object(self, value: Any) -> Any:
        """The main process's ``value`` on every process (each passes its own; only the main one's is kept)."""
        if self.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    # -- models sharded across processes (FSDP2, DeepSpeed ZeRO-3): their forwards and state are collectives
    def check_sharding(self, prepared: nn.Module) -> str:
        """``weight_sharding`` of a prepared model, refusing FSDP v1: its wrapper keeps the root's parameters
        (embeddings, final norm, LM head) in a flat shard that only the wrapper's own forward gathers, and
        generation, a LoRA reference (the policy with its adapters off) and no-grad evaluation run the unwrapped
        module."""
        kind = weight_sharding(prepared)
        if kind == "fsdp1":
            raise RLHFInputError("accelerate config: FSDP v1 (fsdp_version: 1, the default) is not supported, because "
                                 "generation and evaluation run the unwrapped model; set fsdp_version: 2 "
                                 "(configs/accelerate/fsdp.yaml does)")
        return kind

    @contextlib.contextmanager
    def generating_with(self, prepared: nn.Module, policy_model: nn.Module) -> Iterator[None]:
        """Around generation with ``policy_model`` when ``prepared`` (FSDP2) holds it as a submodule rather than
        being it (PPO's actor-critic). FSDP2 gathers the root's own parameters (embeddings, LM head, value head)
        only in the root's forward, which generation bypasses: they are gathered for the whole generation (the
        decoder layers, each its own unit, still gather one at a time). The root is initialised first, because
        FSDP2 insists that its first forward runs through the root, and a rollout comes before any training
        forward. ZeRO-3 hooks every submodule, and a policy that is the root needs neither."""
        if weight_sharding(prepared) != "fsdp2" or self.unwrap(prepared) is policy_model:
            yield
            return
        from torch.distributed.fsdp import fully_shard

        fully_shard.state(prepared)._lazy_init()  # what the root's first forward would do (no public call for it)
        prepared.unshard()
        try:
            yield
        finally:
            prepared.reshard()

    def full_state_dict(self, prepared: nn.Module) -> dict[str, torch.Tensor] | None:
        """A sharded model's weights, whole and keyed as in the unwrapped module, on the main process (None on
        the others), gathered into host memory one tensor at a time on a GPU; None when the model is not sharded
        (save the module itself). Every process must call it: the gather is a collective."""
        kind = weight_sharding(prepared)
        if not kind:
            return None
        if kind == "zero3":  # a module's parameters at a time, kept by the main process only
            module = self.unwrap(prepared)
            state = {}
            for name, tensor in gathered_named_tensors(module, kind):
                if self.is_main_process:
                    state[name] = tensor.cpu()
            first: dict[int, str] = {}
            for name, param in module.named_parameters(remove_duplicate=False):  # tied weights under every name,
                first.setdefault(id(param), name)                                  # apart, as FSDP2 gives them
                if self.is_main_process and name not in state:
                    state[name] = state[first[id(param)]].clone()
            # and the buffers (the main process now holds every parameter name; the others' state is dropped below)
            state.update({name: tensor for name, tensor in module.state_dict().items() if name not in state})
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            offload = self.device.type == "cuda"  # with offload only the main process receives the weights
            state = get_model_state_dict(prepared, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
        # keyed as in the unwrapped module: without torch.compile's wrapper prefix
        return ({k.replace("_orig_mod.", ""): v.detach().cpu() for k, v in state.items()} if self.is_main_process
                else None)

    def full_optimizer_state(self, prepared: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer state of an FSDP2-sharded model, whole (every parameter's moments unsharded) and keyed by
        parameter name, on the main process (None on the others; None when the model is not FSDP2-sharded).
        Every process must call it: the gather is a collective. One file of the main process can then hold it,
        written and rolled like any checkpoint file, instead of a shard file per process."""
        if self.uses_deepspeed:
            return self.deepspeed.optimizer_state(self.unwrap(prepared))
        if weight_sharding(prepared) != "fsdp2":
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        state = get_optimizer_state_dict(prepared, getattr(optimizer, "optimizer", optimizer),
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.is_main_process else None

    def load_full_optimizer_state(self, prepared: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """Load a whole optimizer state keyed by parameter name (``full_optimizer_state``; every process read the
        same file) into the optimizer: of an FSDP2-sharded model, each process keeps the shard of the moments its
        parameters hold; of an unsharded one, every process the whole moments."""
        if self.uses_deepspeed:
            self.deepspeed.load_optimizer_state(self.unwrap(prepared), state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(prepared, getattr(optimizer, "optimizer", optimizer), state,
                                 options=StateDictOptions(full_state_dict=True))

    def load_full_state_dict(self, prepared: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load whole weights (every process read the same file) into a model, sharded or not; each process keeps
        its shard. Keys as in the unwrapped module."""
        kind = weight_sharding(prepared)
        if kind == "zero3":
            self.deepspeed.load_zero3_weights(self.unwrap(prepared), state)
        elif kind:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # a copy: set_model_state_dict swaps the dict's entries for the shards it distributes
            set_model_state_dict(prepared, dict(state), options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            self.unwrap(prepared).load_state_dict(state, strict=False)

    def sync_master_weights(self, module: nn.Module, state: dict[str, torch.Tensor] | None = None) -> None:
        """Under DeepSpeed, its float32 copy of the trainable weights set from the weights just loaded
        (``DeepSpeedSupport.sync_master_weights``); otherwise nothing."""
        self.deepspeed.sync_master_weights(module, state)

    def lockstep_share(self, count: int) -> list[tuple[int, bool]]:
        """This process's share of ``count`` batches split round-robin across processes, as (batch index, keep)
        pairs; all of them, kept, on one process. Every process gets the same number of turns, because a sharded
        model (ZeRO-3, FSDP) gathers its parameters collectively in every forward: a process that runs out repeats
        the last batch with keep False, and discards what it computes."""
        processes = self.num_processes
        turns = range(self.process_index, math.ceil(count / processes) * processes, processes)
        return [(min(index, count - 1), index < count) for index in turns]


def _wandb_mode() -> dict[str, str]:
    """wandb must work on machines without network or account: offline unless a key is set or the user chose a
    WANDB_MODE. Passed to this run's ``wandb.init``, not exported, so the rest of the process is left as it was."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return {}
    return {"mode": "offline"}


SMOOTH_FROM_POINTS = 10  # a metric logged fewer times is plotted as its points alone


def smoothed(values: list[float]) -> list[float]:
    """A centred moving average whose window narrows symmetrically at both ends (to the point itself at the
    first and last). An exponential average trails a falling loss and ends far above where the loss ended; a
    centred one follows a trend, so the line never leaves the data it summarises."""
    half = max(1, len(values) // 20)
    out = []
    for i in range(len(values)):
        reach = min(half, i, len(values) - 1 - i)
        window = values[i - reach:i + reach + 1]
        out.append(sum(window) / len(window))
    return out


def plot_metrics(history: list[dict[str, Any]], output_dir: str | os.PathLike,
                 keys: Iterable[str] | None = None) -> list[Path]:
    """Save one PNG per metric (raw, and smoothed when logged at least SMOOTH_FROM_POINTS times, against step);
    returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = {k for row in history for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
    wanted = [k for k in (keys or sorted(numeric)) if k in numeric]
    written = []
    for key in wanted:
        points = [(row["step"], row[key]) for row in history if key in row and math.isfinite(row[key])]
        if not points:
            continue
        steps, values = zip(*points)
        # an average over a few sparse points (eval every 100 steps) lags far behind them and reads as the trend
        smooth = len(points) >= SMOOTH_FROM_POINTS
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, values, color="#1f77b4", alpha=0.4 if smooth else 1, marker="." if len(points) < 20 else None,
                label="raw")
        if smooth:
            ax.plot(steps, smoothed(list(values)), color="#1f77b4", label="smoothed")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(key)
        ax.grid(alpha=0.3)
        ax.legend()
        path = Path(output_dir) / f"plot_{key.replace('/', '_')}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


class PlainProgress:
    """Progress as log lines, for output that is not a terminal: one line when ``interval`` seconds have passed
    since the last (and one at the end) with step/total, the rate since this run started, the ETA and the last
    logged loss. It mirrors the few calls ``TrainingLogger`` makes on rich's ``Progress``."""

    def __init__(self, description: str, total: int, start: int, interval: float) -> None:
        self.description, self.total, self.start, self.done, self.interval = description, total, start, start, interval
        self.began = self.last_line = time.monotonic()
        self.loss, self.speed = "-", ""

    def update(self, _task: Any = None, *, loss: str = "-", speed: str = "") -> None:
        self.loss, self.speed = loss, speed

    def advance(self, _task: Any = None, steps: int = 1) -> None:
        self.done += steps
        now = time.monotonic()
        if now - self.last_line >= self.interval or self.done >= self.total:
            self.last_line = now
            logger.info("%s", self.line(now))

    def line(self, now: float) -> str:
        """'sft: step 120/600 (20%), 1.52 steps/s, eta 5m16s, loss 0.4123 (812 tok/s, MFU 3.1%)'."""
        elapsed, finished = now - self.began, self.done - self.start
        rate = finished / elapsed if elapsed > 0 else 0.0
        eta = f"{_duration((self.total - self.done) / rate)}" if rate > 0 else "?"
        speed = f"{rate:.2f} steps/s" if rate >= 0.1 else f"{1 / rate:.1f} s/step" if rate > 0 else "- steps/s"
        return (f"{self.description}: step {self.done}/{self.total} ({100 * self.done / max(1, self.total):.0f}%), "
                f"{speed}, eta {eta}, loss {self.loss}" + (f" ({self.speed})" if self.speed else ""))

    def stop(self) -> None:
        pass


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


# ---- Throughput: the model FLOPs a step does and the device's peak, for model FLOP utilisation (MFU) ----

# dense bf16 / fp16 tensor-core peaks in FLOP/s of known accelerators, matched against torch.cuda.get_device_name()
# (the first key the name contains: the more specific names come first); a float32 run is measured against half of
# it (TF32). An accelerator not listed gets no MFU unless mfu_peak_flops names its peak.
GPU_PEAK_FLOPS = {"GB200": 2.5e15, "B200": 2.25e15, "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12,
                  "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12,
                  "L4": 121e12, "A10": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12,
                  "MI300X": 1307e12, "MI250X": 383e12}
CPU_PEAK_FILE = "cpu_peak_flops.json"  # in the rlhf cache: a CPU's float32 matmul rate, measured once per thread count


@dataclass(frozen=True)
class ModelShape:
    """What a transformer's FLOPs per token depend on: its matmul parameters (the input embedding is a lookup, not a
    matmul; a tied output layer is one), layers and width."""

    matmul_params: int
    layers: int
    width: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        total = sum(parameter_numel(p) for p in model.parameters())
        lookup = parameter_numel(embedding.weight) if embedding is not None else 0
        tied = output is not None and embedding is not None and output.weight is embedding.weight
        return cls(total - lookup + (lookup if tied else 0), int(getattr(text, "num_hidden_layers", 0) or 0),
                   int(getattr(text, "hidden_size", 0) or 0))

    def training_flops(self, lengths: Iterable[int]) -> float:
        """A forward and backward pass over sequences of ``lengths`` tokens: 6 FLOPs per matmul parameter and token,
        plus attention's 12 x layers x width x sequence length per token (PaLM's appendix B, as torchtitan and
        prime-rl count MFU)."""
        return float(sum(n * (6 * self.matmul_params + 12 * self.layers * self.width * n) for n in lengths))


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """GPU_PEAK_FLOPS' entry for a device name (half of it for float32), or None for a device not listed."""
    peak = next((value for key, value in GPU_PEAK_FLOPS.items() if key in name), None)
    return None if peak is None else peak if dtype in (torch.bfloat16, torch.float16) else peak / 2


def measured_cpu_peak_flops(cache: Path, threads: int | None = None, size: int = 1024) -> float:
    """This CPU's float32 matmul rate at ``threads`` threads (the best of a few timed runs of size x size matmuls),
    measured once and kept in ``cache``/CPU_PEAK_FILE, keyed by the processor and the thread count."""
    import platform

    threads = threads or torch.get_num_threads()
    key = f"{platform.machine()} {_cpu_model()} x{threads}"
    path = cache / CPU_PEAK_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return float(known[key])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        numbers = torch.Generator().manual_seed(0)  # not the run's generator: measuring must not move its samples
        a, b = torch.randn(size, size, generator=numbers), torch.randn(size, size, generator=numbers)
        torch.mm(a, b)  # warm-up
        best = 0.0
        for _ in range(3):
            started, count = time.perf_counter(), 0
            while count < 2 or time.perf_counter() - started < 0.1:
                torch.mm(a, b)
                count += 1
            best = max(best, 2 * size ** 3 * count / (time.perf_counter() - started))
    finally:
        torch.set_num_threads(previous)
    known[key] = best
    try:
        cache.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(known, indent=1))
    except OSError:  # a read-only cache: measured again next time
        pass
    return best


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def device_peak_flops(device: torch.device, dtype: torch.dtype, cache: Path) -> float | None:
    """The peak an MFU of ``device`` is measured against: a known GPU's tensor-core peak, a CPU's measured matmul
    rate; None for anything else."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return measured_cpu_peak_flops(cache)
    return None


class TrainingLogger:
    """Progress bar, metric history, JSONL file, trackers (tensorboard / wandb) and PNG curves.

    Everything a run reports passes through ``log``; only the main process writes.
    """

    def __init__(self, output_dir: str | os.PathLike, total_steps: int, devices: DeviceManager,
                 config: BaseConfig, description: str = "train", start_step: int = 0) -> None:
        self.output_dir = Path(output_dir)
        self.devices = devices
        self.config = config
        self.history: list[dict[str, Any]] = []
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.active = devices.is_main_process
        self._progress = None
        if not self.active:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._reload_history(start_step)
        if config.report_to:
            run = config.run_name or f"{config.stage}-{time.strftime('%Y%m%d-%H%M%S')}"
            flat = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in config.to_dict().items()}
            wandb = {"name": run, "dir": str(self.output_dir), **_wandb_mode()}
            devices.accelerator.init_trackers(project_name=f"rlhf-{config.stage}", config=flat,
                                              init_kwargs={"wandb": wandb})
        if not config.disable_progress_bar:
            self._start_progress(total_steps, start_step, description)

    def _reload_history(self, start_step: int) -> None:
        """On resume keep the metrics logged up to the checkpoint and drop the ones after it."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line)
                if row.get("step", 0) <= start_step:
                    kept.append(row)
        self.history = kept if start_step > 0 else []
        write_text_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.history))

    def _start_progress(self, total: int, start: int, description: str) -> None:
        """rich's bar on a terminal; elsewhere (a pipe, a CI log, a file) rich draws nothing until the end, so a
        plain line every ``progress_interval`` seconds shows the stage is alive."""
        if not rich_console().is_terminal:
            self._progress, self._task = PlainProgress(description, total, start, self.config.progress_interval), None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]}"),
                                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                  transient=False)
        self._task = self._progress.add_task(description, total=total, completed=start, loss="-", speed="")
        self._progress.start()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        row = {"step": step, **{k: (float(v) if isinstance(v, (int, float, torch.Tensor)) else v)
                                for k, v in metrics.items()}}
        self.history.append(row)
        with self.metrics_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        if self.config.report_to:
            numeric = {k: v for k, v in row.items() if isinstance(v, float)}
            self.devices.accelerator.log(numeric, step=step)
        if self._progress is not None and "loss" in row:
            speed = f"{row['perf/tokens_per_s']:.0f} tok/s" if "perf/tokens_per_s" in row else ""
            if "perf/mfu" in row:
                speed += f", MFU {100 * row['perf/mfu']:.1f}%"
            self._progress.update(self._task, loss=f"{row['loss']:.4f}", speed=speed)
        elif self._progress is None:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float))
            logger.info("step %d: %s", step, shown)

    def advance(self, steps: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, steps)

    def close(self) -> list[Path]:
        """Stop the bar, flush trackers, and write PNG curves when ``plot_loss`` is on."""
        if not self.active:
            return []
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.config.report_to:
            self.devices.accelerator.end_training()
        if self.config.plot_loss and self.history:
            return plot_metrics(self.history, self.output_dir)
        return []


# -- checkpoint state that is not a model: optimizer, scheduler, RNG, trainer position.
# Everything is stored as safetensors + JSON; nothing is pickled (docs/architecture.md, conventions).


def optimizer_state_to_safetensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer ``state_dict`` into flat tensors and a JSON-able remainder."""
    tensors, scalars = {}, {}
    for param_id, param_state in state["state"].items():
        for key, value in param_state.items():
            name = f"{param_id}.{key}"
            if isinstance(value, torch.Tensor):
                tensors[name] = value.detach().cpu().contiguous()
            else:
                scalars[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_state_from_safetensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int | str, dict[str, Any]] = {}
    for name, value in list(tensors.items()) + list(meta["scalars"].items()):
        param_id, key = name.rsplit(".", 1)  # a parameter index, or a name (a sharded model's gathered state)
        state.setdefault(int(param_id) if param_id.isdigit() else param_id, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every random generator a training step touches, as tensors + JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(keys.astype(np.int64))
    version, py_state, gauss = random.getstate()
    return tensors, {"numpy": [kind, int(pos), int(has_gauss), float(cached)],
                     "python": [version, list(py_state), gauss]}


def restore_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda_states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda."))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, py_state, gauss = meta["python"]
    random.setstate((version, tuple(py_state), gauss))


def _write_json_atomic(path: Path, payload: dict[str, Any], indent: int = 1) -> None:
    """``path`` written whole or not at all: JSON written to a temporary file beside it, flushed to disk, renamed."""
    write_text_atomic(path, json.dumps(payload, indent=indent, default=float))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a kill, a full disk or a power loss leaves the old file or the new one,
    never half of either: a temporary file beside it, fsynced, renamed over it, and the folder fsynced."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # a folder cannot be opened for fsync on every file system
        _fsync_directory(path.parent)


# what a model loader reads from a model folder (transformers, PEFT, vLLM, this project's heads): a final save deletes
# the ones an earlier model left that it does not write itself
MODEL_FILE_PATTERNS = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                       "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
                       "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin",
                       "reward_head.safetensors", "reward_config.json", "prm_config.json", "value_head.safetensors",
                       "critic")


FINAL_SAVE_MARKER = ".final-save-incomplete"  # in a folder whose model a final save was replacing when it was killed


def stale_model_files(folder: Path, written: set[str]) -> list[Path]:
    """The model files in ``folder`` (MODEL_FILE_PATTERNS) that a new save writing ``written`` would leave behind."""
    return sorted({path for pattern in MODEL_FILE_PATTERNS for path in folder.glob(pattern)
                   if path.name not in written})


def _fsync_tree(root: Path) -> None:
    """Flush file contents to disk before the rename that publishes them."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    if os.name == "nt":  # Windows cannot open a directory for fsync
        return
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _complete_checkpoints(root: Path) -> list[Path]:
    """The checkpoint-N directories under ``root`` that hold their COMPLETE marker, oldest first."""
    prefix = CheckpointManager.prefix
    found = [p for p in Path(root).glob(f"{prefix}*")
             if p.is_dir() and p.name[len(prefix):].isdigit() and (p / "COMPLETE").exists()]
    return sorted(found, key=lambda p: int(p.name[len(prefix):]))


def _other_stage_checkpoint_error(path: Path, saved_stage: str, stage: str, explicit: bool) -> RLHFInputError:
    """The one-line error for resuming ``stage`` from a ``saved_stage`` checkpoint."""
    if explicit:
        return RLHFInputError(f"config field 'resume_from_checkpoint': {path} is a '{saved_stage}' checkpoint, and "
                              f"this run trains '{stage}'; point it at a '{stage}' checkpoint")
    return RLHFInputError(f"{path.parent.parent} holds '{saved_stage}' checkpoints, and this run trains '{stage}': set "
                          "output_dir to another directory, or resume_from_checkpoint=none to start over (removes "
                          "them)")


def _changed_structure_error(path: Path, changes: list[str], explicit: bool) -> RLHFInputError:
    """The one-line error for resuming a checkpoint that holds other parameters (LoRA against full, another rank)."""
    what = "; ".join(changes)
    if explicit:
        return RLHFInputError(f"config field 'resume_from_checkpoint': {path} cannot be resumed with {what}: its "
                              "weights and optimizer state fit the old settings; resume with those, or start over with "
                              f"resume_from_checkpoint=none")
    return RLHFInputError(f"{path.parent.parent} holds checkpoints that this run cannot resume ({what}): set "
                          "output_dir to another directory, or resume_from_checkpoint=none to start over (removes "
                          "them)")


class RunFolderLock:
    """One run per output_dir: an exclusive ``flock`` on ``output_dir/.rlhf.lock`` for the run's life, the holder's
    pid, host and start time written inside, so that a second run into the folder (which would sweep the first's
    checkpoint in the making, roll its checkpoints away and resume from them) is refused in one line naming the
    holder. The kernel drops the lock with its process: a killed run's lock is taken over by the next run.
    ``hold(folder)`` is the one this process holds for a folder (taken at most once per folder); ``release``;
    ``for_run(folder)`` holds it for a block."""

    name = ".rlhf.lock"
    held: dict[str, RunFolderLock] = {}  # folder (real path) -> this process's lock of it

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder, self.fd = Path(folder), None

    @classmethod
    def hold(cls, folder: str | os.PathLike) -> RunFolderLock:
        key = os.path.realpath(folder)
        if key not in cls.held:
            cls.held[key] = cls(folder)._acquire()
        return cls.held[key]

    @classmethod
    @contextlib.contextmanager
    def for_run(cls, folder: str | os.PathLike, *, take: bool = True) -> Iterator[None]:
        """The folder held through the block (``take``: taken now; else only a lock the block takes, as a stage runner's
        ``_start_stage`` does) and let go of after it, however it ends, unless this process held it before."""
        key = os.path.realpath(folder)
        held_before = key in cls.held
        if take:
            cls.hold(folder)
        try:
            yield
        finally:
            lock = cls.held.get(key)
            if lock is not None and not held_before:
                lock.release()

    def _acquire(self) -> RunFolderLock:
        import fcntl
        import socket

        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / self.name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise RLHFInputError(f"output_dir {self.folder} is in use by another run ({holder}); wait for it to end, "
                                 f"or give this run another output_dir") from None
        previous = _lock_holder(os.pread(fd, 4096, 0))
        if previous != "unknown":
            logger.info("%s: the lock of an earlier run (%s) was left by a process that ended; taken over",
                        self.folder, previous)
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine, 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Unlock (the file stays, empty: removing it would race a run that just opened it)."""
        import fcntl

        RunFolderLock.held.pop(os.path.realpath(self.folder), None)
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def releases_output_dir(runner: Callable[..., Any]) -> Callable[..., Any]:
    """A stage runner (``runner(config, ...)``) that lets go of the output_dir lock its run took (``_start_stage``),
    however it ends: a run that fails before it trains would otherwise keep the folder locked for the rest of its
    process's life (a notebook's, a test session's)."""
    @functools.wraps(runner)
    def run(config: Any, *args: Any, **kwargs: Any) -> Any:
        with RunFolderLock.for_run(config.output_dir, take=False):
            return runner(config, *args, **kwargs)

    return run


def _lock_holder(raw: bytes) -> str:
    """A RunFolderLock file's holder in words ('unknown' for an empty or unreadable one)."""
    try:
        holder = json.loads(raw)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "unknown"


class CheckpointManager:
    """Atomic, rolling checkpoints under ``output_dir/checkpoints``.

    A checkpoint is written into a hidden temporary directory and published with one ``rename``,
    so a run killed at any moment leaves either the complete checkpoint or none; the newest
    ``save_total_limit`` are kept and half-written leftovers are removed on start.
    """

    prefix = "checkpoint-"

    def __init__(self, output_dir: str | os.PathLike, save_total_limit: int = 3, *, sweep: bool = True) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.save_total_limit = save_total_limit
        self.root.mkdir(parents=True, exist_ok=True)
        if sweep:
            self.sweep()

    def sweep(self) -> None:
        """Remove what a killed run left half-written (only while holding the folder: RunFolderLock)."""
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return _complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def load_latest(self, read: Callable[[Path], None]) -> Path | None:
        """Restore from the newest complete checkpoint (one with its COMPLETE marker) with ``read``; its path, or
        None when there is none."""
        path = self.latest()
        if path is not None:
            read(path)
        return path

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Call ``write(tmp_dir)`` to fill a new checkpoint, then publish it atomically and roll."""
        final = self.root / f"{self.prefix}{step}"
        tmp = self.root / f".tmp-{self.prefix}{step}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            write(tmp)
            (tmp / "COMPLETE").write_text(str(step))
            _fsync_tree(tmp)
            # a re-save of the same step sets the old copy aside before the new one takes its name, and deletes
            # it after: a kill at any moment leaves a complete checkpoint-N (old or new) and at most a .tmp-* leftover
            old = self._set_aside(final) if final.exists() else None
            os.rename(tmp, final)
            _fsync_directory(self.root)  # make the rename itself durable, not just the files
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._roll()
        return final

    def _roll(self) -> None:
        for old in self.checkpoints()[:-self.save_total_limit]:
            shutil.rmtree(self._set_aside(old), ignore_errors=True)

    def clear(self) -> None:
        for path in self.root.glob(f"{self.prefix}*"):  # complete or not
            shutil.rmtree(self._set_aside(path), ignore_errors=True)

    def _set_aside(self, path: Path) -> Path:
        """Rename a checkpoint to a .tmp-* name before it is deleted: a kill during the delete leaves a leftover
        removed on the next start, never a half-deleted checkpoint-N that still holds its COMPLETE marker."""
        aside = self.root / f".tmp-discard-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, aside)
        return aside


def _checkpoint_read_errors() -> tuple[type[BaseException], ...]:
    # JSON errors are ValueErrors
    errors: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, RuntimeError)
    try:
        return errors + (SafetensorError,)
    except ImportError:
        return errors


CHECKPOINT_READ_ERRORS = _checkpoint_read_errors()  # what a damaged checkpoint file raises while it loads


PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")  # a scheduler's stop; SLURM's --signal=USR1@seconds sends USR1 ahead


class PreemptionGuard:
    """For the length of a training run, SIGTERM and SIGUSR1 set ``received`` instead of ending the process, so the
    trainer finishes its optimizer step, writes a checkpoint and exits (``TrainingPreempted``); the previous
    handlers come back afterwards. Only the main thread can take signals; elsewhere this does nothing."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for name in PREEMPTION_SIGNALS:
                number = getattr(signal, name, None)  # Windows has no SIGUSR1
                if number is not None:
                    self._previous[number] = signal.signal(number, self._note)
        return self

    def _note(self, number: int, frame: Any) -> None:
        if self.received is None:
            logger.warning("%s received: finishing this optimizer step, then writing a checkpoint and stopping",
                           signal.Signals(number).name)
        self.received = signal.Signals(number)

    def __exit__(self, *exc: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


class CheckpointingMixin:
    """A trainer's checkpoints: model, optimizer, schedule, RNG and trainer state written atomically through
    ``self.checkpoints`` (a CheckpointManager), resumed exactly (or from the newest readable one), and the
    final model published at output_dir. Its host, BaseTrainer, supplies ``config``, ``devices``, ``model``,
    ``optimizer``, ``scheduler``, ``sampler``, ``train_dataset``, ``early_stopping``, ``global_step``,
    ``micro_batches_done``, ``stage``, ``output_dir`` and ``sharded``, and writes / reads the model itself in
    Hugging Face layout (``_save_model`` / ``_load_model``)."""

    gathered_weights: dict[str, torch.Tensor] | None = None  # a sharded model's weights while they are written

    def _extra_state(self) -> dict[str, Any]:
        """Trainer state beyond model/optimizer/schedule/RNG that exact resume needs (JSON)."""
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    SHARDED_WEIGHTS_FILE = "model_state.safetensors"

    @contextlib.contextmanager
    def _weights_gathered(self, optimizer: bool = False) -> Iterator[None]:
        """A sharded model's weights (and with ``optimizer`` its FSDP2 optimizer state) gathered whole onto the main
        process for the writes inside (every process enters: the gathers are collectives); nothing otherwise."""
        self.gathered_weights = self.devices.full_state_dict(self.model) if self.sharded else None
        gather_optimizer = (optimizer and (self.sharded or self.devices.uses_deepspeed)
                            and not self.config.save_only_model)
        self.gathered_optimizer = (self.devices.full_optimizer_state(self.model, self.optimizer) if gather_optimizer
                                   else None)
        try:
            yield
        finally:
            self.gathered_weights = self.gathered_optimizer = None

    def _save_checkpoint(self) -> None:
        with self._weights_gathered(optimizer=True):
            if self.devices.is_main_process:
                path = self.checkpoints.save(self.global_step, self._write_checkpoint)
                logger.debug("checkpoint written: %s", path)
        self.devices.wait()

    def _write_checkpoint(self, directory: Path) -> None:
        # sharded: the gathered weights as the prepared module names them, which resume loads back into the shards;
        # sharded or under DeepSpeed (whose optimizer partitions its state at any ZeRO stage): the gathered optimizer
        # state keyed by parameter name
        model_only = self.config.save_only_model
        if self.sharded:
            save_file({k: v.contiguous() for k, v in self.gathered_weights.items()},
                      str(directory / self.SHARDED_WEIGHTS_FILE))
        else:
            self._save_model(directory)
        state = {"global_step": self.global_step, "micro_batches_done": self.micro_batches_done,
                 "stage": self.stage, "config": self.config.to_dict(), "trainer": self._extra_state(),
                 "early_stopping": self.early_stopping.state_dict() if self.early_stopping else None,
                 "data": self.train_dataset.state_dict() if self.sampler is None else None,
                 "model_only": model_only}
        if not model_only:
            optimizer_state = (self.gathered_optimizer if self.gathered_optimizer is not None
                               else self.optimizer.state_dict())
            tensors, meta = optimizer_state_to_safetensors(optimizer_state)
            save_file(tensors, str(directory / "optimizer.safetensors"))
            (directory / "optimizer.json").write_text(json.dumps(meta))
            (directory / "scheduler.json").write_text(json.dumps(self.scheduler.state_dict()))
            rng_tensors, rng_meta = capture_rng_state()
            save_file(rng_tensors, str(directory / "rng_state.safetensors"))
            (directory / "rng_state.json").write_text(json.dumps(rng_meta))
        (directory / "trainer_state.json").write_text(json.dumps(state, indent=1, default=str))

    def _resume(self) -> None:
        choice = self.config.resume_from_checkpoint
        if self.config.overwrite_output_dir or choice == "none":
            found = self.checkpoints.checkpoints()
            if found:  # a fresh start must not roll or later resume into old steps; say so before deleting
                # (resume_from_checkpoint=none may be the pipeline's, for a stage whose config changed: no advice)
                overwrite = self.config.overwrite_output_dir
                logger.warning("%s: deleting %d checkpoint(s) in %s (the newest at step %s) and starting over%s",
                               "overwrite_output_dir=true" if overwrite else "resume_from_checkpoint=none", len(found),
                               self.checkpoints.root, found[-1].name.removeprefix(CheckpointManager.prefix),
                               "; run with overwrite_output_dir=false to resume from them instead" if overwrite else "")
            self.checkpoints.clear()
            return
        if choice == "auto":
            path = self._resume_newest_readable()
            if path is None:
                return
        else:
            path = Path(choice)
            if not path.exists():
                raise RLHFInputError(f"config field 'resume_from_checkpoint': {path} does not exist; give a "
                                     f"checkpoint directory, 'auto' or 'none'")
            if not (path / "COMPLETE").exists():
                raise RLHFInputError(f"config field 'resume_from_checkpoint': {path} is not a complete checkpoint "
                                     f"(no COMPLETE marker: not a checkpoint, or interrupted while saving)")
            problem = self._load_readable_checkpoint(path)
            if problem:
                raise RLHFInputError(f"config field 'resume_from_checkpoint': {path} cannot be read ({problem}); "
                                     f"resume from another checkpoint or set resume_from_checkpoint=none")
        logger.info("resumed from %s at step %d", path, self.global_step)

    def _resume_advice(self) -> str:
        """What to run after an interrupt, true for this config: a config that starts over would delete the
        checkpoints the usual advice promises to resume from."""
        latest = self.checkpoints.latest()
        if latest is None:
            return "interrupted before the first checkpoint: running the same command again starts over"
        where = f"the last checkpoint is {latest}"
        if self.config.overwrite_output_dir:
            return (f"interrupted: {where}, but this config sets overwrite_output_dir=true, which deletes it on the "
                    f"next run; to resume, run the same command with overwrite_output_dir=false")
        if self.config.resume_from_checkpoint == "none":
            return (f"interrupted: {where}, but this config sets resume_from_checkpoint=none, which deletes it on the "
                    f"next run; to resume, run the same command with resume_from_checkpoint=auto")
        return f"interrupted: {where}; run the same command again to resume from it"

    def _load_readable_checkpoint(self, path: Path) -> str | None:
        """Load ``path``; what was wrong with its files when one is damaged (None when it loaded). Another
        stage's checkpoint is the user's mistake, not damage, and stays an error."""
        try:
            self._load_checkpoint(path)
        except RLHFInputError:
            raise
        except CHECKPOINT_READ_ERRORS as err:
            return _one_line(err)
        return None

    def _resume_newest_readable(self) -> Path | None:
        """Auto-resume: the newest complete checkpoint that loads. One whose files are damaged (a disk error,
        a hand edit) is reported and the one before it tried, so a bad file costs save_steps, not the run.
        Loading overwrites everything a checkpoint holds, so a failed partial load leaves nothing behind."""
        found = self.checkpoints.checkpoints()
        incomplete = sorted(p.name for p in self.checkpoints.root.glob(f"{self.checkpoints.prefix}*")
                            if p.is_dir() and p not in found) if self.checkpoints.root.is_dir() else []
        if incomplete:
            logger.info("skipping %s: no COMPLETE marker (interrupted while saving)", ", ".join(incomplete))
        failures = []
        for path in reversed(found):
            problem = self._load_readable_checkpoint(path)
            if problem is None:
                if failures:
                    logger.warning("resumed from the older %s because %s", path.name, "; ".join(failures))
                return path
            failures.append(f"{path.name} cannot be read ({problem})")
        if failures:
            raise RLHFInputError(f"no checkpoint in {self.checkpoints.root} can be read: {'; '.join(failures)}; "
                                 f"set resume_from_checkpoint=none to start over")
        return None

    def _load_checkpoint(self, path: Path) -> None:
        state = json.loads((path / "trainer_state.json").read_text())
        self._check_resumable(path, state)
        sharded_weights = path / self.SHARDED_WEIGHTS_FILE
        if sharded_weights.exists():  # written by a sharded run: every process reads it and keeps its shard
            self.devices.load_full_state_dict(self.model, load_file(str(sharded_weights)))
        elif self.sharded:
            raise RLHFInputError(f"{path} was written by a run whose weights were not sharded across processes; resume "
                                 f"it with the same launch configuration, or start from its weights "
                                 f"(model_name_or_path={path})")
        else:
            self._load_model(path)
            self.devices.sync_master_weights(self.devices.unwrap(self.model))  # ZeRO-1/2's float32 copy
        self._load_extra_state(state.get("trainer") or {})
        self.global_step, self.micro_batches_done = state["global_step"], state["micro_batches_done"]
        if self.early_stopping and state.get("early_stopping"):
            self.early_stopping.load_state_dict(state["early_stopping"])
        if self.sampler is None and state.get("data"):
            self.train_dataset.load_state_dict(state["data"])
        if state.get("model_only"):
            logger.warning("%s holds weights only (save_only_model): the "
                           "optimizer's moments restart and the schedule continues from step %d",
                           path, self.global_step)
            with warnings.catch_warnings():  # stepping the schedule to where it was, before any optimizer step
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                for _ in range(self.global_step):
                    self.scheduler.step()
            return
        meta = json.loads((path / "optimizer.json").read_text())
        optimizer_state = optimizer_state_from_safetensors(load_file(str(path / "optimizer.safetensors")), meta)
        # keyed by parameter name when a sharded run gathered it (into shards again, or whole parameters); by index
        # otherwise, which a sharded run never gets here with: its weights check above refused the checkpoint
        if isinstance(optimizer_state["param_groups"][0]["params"][0], str):
            self.devices.load_full_optimizer_state(self.model, self.optimizer, optimizer_state)
        else:
            self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
        restore_rng_state(load_file(str(path / "rng_state.safetensors")),
                          json.loads((path / "rng_state.json").read_text()))

    # settings that say how long a run goes, where and how it reports and evaluates, not what it trains:
    # changing them is a normal resume (extending max_steps is the usual one)
    RESUME_NEUTRAL_FIELDS = frozenset({"output_dir", "logging_dir", "resume_from_checkpoint", "overwrite_output_dir",
                                       "report_to", "run_name", "disable_progress_bar", "progress_interval",
                                       "logging_steps", "save_steps",
                                       "save_total_limit", "save_only_model", "eval_steps", "plot_loss", "max_steps",
                                       "num_train_epochs", "dataloader_num_workers", "preprocessing_num_workers",
                                       "ddp_timeout", "cache_dir", "eval_dataset", "per_device_eval_batch_size",
                                       "eval_max_new_tokens", "eval_before_training"})

    # settings that decide which parameters a checkpoint holds: its weights and optimizer state fit no others
    RESUME_STRUCTURAL_FIELDS = ("finetuning_type", "lora_rank", "lora_target", "additional_target",
                                "freeze_trainable_layers")

    def _check_resumable(self, path: Path, state: dict[str, Any]) -> None:
        """Refuse another stage's checkpoint (its files and optimizer do not fit this trainer); warn when the
        settings changed since it was written, since the optimizer and schedule continue from it regardless."""
        stage = state.get("stage")
        if stage and stage != self.stage:
            raise _other_stage_checkpoint_error(path, stage, self.stage, self.config.resume_from_checkpoint != "auto")
        saved, now = state.get("config") or {}, json.loads(json.dumps(self.config.to_dict(), default=str))

        def changes(keys: Iterable[str]) -> list[str]:
            return [f"{key} {saved[key]!r} -> {now[key]!r}" for key in keys if key in saved and key in now
                    and saved[key] != now[key]]

        structural = changes(k for k in self.RESUME_STRUCTURAL_FIELDS
                             if k != "freeze_trainable_layers" or now.get("finetuning_type") == "freeze")
        if structural:
            raise _changed_structure_error(path, structural, self.config.resume_from_checkpoint != "auto")
        length = changes(("max_steps", "num_train_epochs"))
        if length:
            logger.info("resuming %s with a new length: %s", path, "; ".join(length))
        changed = changes(key for key in sorted(now) if key not in self.RESUME_NEUTRAL_FIELDS)
        if changed:
            logger.warning("resuming %s with settings changed since it was written: %s%s. The run continues from the "
                           "checkpoint; to train from scratch with the new settings set resume_from_checkpoint=none or "
                           "another output_dir", path, "; ".join(changed[:6]),
                           f" (and {len(changed) - 6} more)" if len(changed) > 6 else "")

    def _save_final_model(self) -> None:
        """The trained model in Hugging Face layout at output_dir, replacing the folder's model as a set: written to a
        temporary folder (removed whatever happens; one a killed save left is swept first), then every model file of
        an earlier model that the new save does not write is deleted (a LoRA run's adapter beside a later full
        model's weights would otherwise be loaded on top of them), then the new files are renamed into place. A kill
        in the middle leaves FINAL_SAVE_MARKER (every loader refuses the half-replaced folder in one line) and the
        final checkpoint, and the rerun that resumes from it saves the model again."""
        with self._weights_gathered():
            if self.devices.is_main_process:
                for leftover in self.output_dir.glob(".tmp-final-*"):
                    shutil.rmtree(leftover, ignore_errors=True)
                tmp = self.output_dir / f".tmp-final-{uuid.uuid4().hex[:8]}"
                try:
                    self._save_model(tmp)
                    _fsync_tree(tmp)
                    write_text_atomic(self.output_dir / FINAL_SAVE_MARKER, "a final save is replacing this model\n")
                    for stale in stale_model_files(self.output_dir, {item.name for item in tmp.iterdir()}):
                        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
                    for item in tmp.iterdir():
                        target = self.output_dir / item.name
                        if item.is_dir() and target.is_dir():  # os.replace cannot overwrite a non-empty directory
                            shutil.rmtree(target)
                        os.replace(item, target)
                    _fsync_directory(self.output_dir)
                    (self.output_dir / FINAL_SAVE_MARKER).unlink()
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        self.devices.wait()


def _scheduler_kwargs(name: str, warmup: int, num_training_steps: int) -> dict[str, Any]:
    """The extra arguments two transformers schedules require, with the usual defaults: cosine decays
    to 10% of the peak rate; warmup-stable-decay spends its last 10% of steps decaying."""
    if name == "cosine_with_min_lr":
        return {"min_lr_rate": 0.1}
    if name == "warmup_stable_decay":
        return {"num_decay_steps": max(1, (num_training_steps - warmup) // 10)}
    return {}


@functools.cache
def _fused_optimizer_devices() -> tuple[str, ...]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper: the devices every recent release covers
        return ("cpu", "cuda")


def create_optimizer(model: nn.Module, config: BaseConfig, num_training_steps: int
                     ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over trainable parameters (no weight decay on biases and norms) and a transformers schedule.
    ``optim: adamw_torch_fused`` takes the fused kernel where the parameters' device and dtype have it
    (CPU, CUDA): one pass over every tensor instead of a loop over them, several times faster per step on
    small models, whose step time is the loop's overhead. It is not the default because it rounds
    differently, and where a skill is learned in a sudden jump that alone can move where a run lands."""
    from transformers import get_scheduler

    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:  # (a parameter DeepSpeed built partitioned is 1-d here: its ds_shape is its own)
            (decay if len(getattr(param, "ds_shape", param.shape)) >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise RLHFInputError("config field 'finetuning_type' leaves no trainable parameters; "
                             "check lora_target or freeze_trainable_layers")
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    settings = dict(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon)
    fused = config.optim == "adamw_torch_fused" and all(
        p.device.type in _fused_optimizer_devices() and p.is_floating_point() for g in groups for p in g["params"])
    optimizer = torch.optim.AdamW(groups, fused=fused or None, **settings)
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * num_training_steps)
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                              num_training_steps=num_training_steps,
                              scheduler_specific_kwargs=_scheduler_kwargs(config.lr_scheduler_type, warmup,
                                                                          num_training_steps))
    return optimizer, scheduler


class EarlyStopping:
    """Stop when the watched metric has not improved by ``min_delta`` for ``patience`` evaluations."""

    def __init__(self, patience: int, mode: str = "min", min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError("mode must be 'min' or 'max'")
        self.patience, self.mode, self.min_delta = patience, mode, min_delta
        self.best: float | None = None
        self.bad_evaluations = 0

    def step(self, value: float) -> bool:
        """Record one evaluation; True means stop now."""
        improved = self.best is None or (
            value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta)
        if improved:
            self.best, self.bad_evaluations = value, 0
        else:
            self.bad_evaluations += 1
        return self.bad_evaluations >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_evaluations = state["best"], state["bad_evaluations"]


def _is_linear(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def find_linear_module_names(model: nn.Module) -> list[str]:
    """Short names of every linear layer (``q_proj``, ``c_attn``, ``in_proj`` ...) except output heads,
    so ``lora_target: all`` works on any architecture without a per-model list."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for full_name, module in model.named_modules():
        short = full_name.rsplit(".", 1)[-1]
        if _is_linear(module) and module is not head and short not in ("lm_head", "score", "v_head", "classifier"):
            names.add(short)
    return sorted(names)


def find_expert_parameter_names(model: nn.Module) -> list[str]:
    """Fused expert weights of mixture-of-experts layers, as ``module.parameter`` (``experts.gate_up_proj``): the
    3-D parameters (experts x out x in) an experts module holds itself. transformers 5 stores Mixtral's and Qwen3-MoE's
    experts so, not as linear layers, so LoRA reaches them only through PEFT's ``target_parameters``."""
    names = set()
    for full_name, module in model.named_modules():
        if "expert" not in type(module).__name__.lower():  # Qwen3MoeExperts, MixtralExperts; not Mamba's Conv1d
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.ndim == 3:
                names.add(f"{full_name.rsplit('.', 1)[-1]}.{name}")
    return sorted(names)


@contextlib.contextmanager
def _peft_deprecation_quiet() -> Iterator[None]:
    """peft reads transformers' deprecated ``is_gradient_checkpointing``; the FutureWarning is about peft's code,
    not the user's, and would print on every LoRA run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer/state-space blocks: the largest ModuleList in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise RLHFInputError("finetuning_type=freeze: could not find the model's stack of layers; use lora or full")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def apply_freeze(model: nn.Module, trainable_layers: int) -> nn.Module:
    """Freeze everything except the last ``trainable_layers`` blocks (the first ones if negative)."""
    blocks = _decoder_blocks(model)
    count = min(abs(trainable_layers), len(blocks))
    chosen = blocks[len(blocks) - count:] if trainable_layers > 0 else blocks[:count]
    model.requires_grad_(False)
    for block in chosen:
        block.requires_grad_(True)
    return model


def compile_model(model: nn.Module, enabled: bool = True, backend: str = "inductor") -> nn.Module:
    """Opt-in ``torch.compile``. A backend that cannot start leaves the model eager, with a warning; a graph that
    fails to compile later runs eagerly too (dynamo's ``suppress_errors``), but only inside this model's own calls:
    the setting is switched on around each call and back off after it, never left on for the process, where it
    would hide compile errors in the caller's other code."""
    if not enabled:
        return model
    try:
        compiled = torch.compile(model, backend=backend)
    except Exception as err:  # backend missing, unsupported platform: training must go on
        logger.warning("torch.compile failed (%s); continuing without compilation", str(err).splitlines()[0])
        return model
    compiled.forward = _eager_on_compile_error(compiled.forward)
    logger.info("model compiled with torch.compile (backend=%s)", backend)
    return compiled


def compile_training_step(model: nn.Module, enabled: bool = True, backend: str = "inductor") -> nn.Module:
    """``torch_compile``: each decoder block's forward (and so its backward, through AOTAutograd) compiled in place,
    torchtune's and torchtitan's per-block scheme: the blocks share one code object, so one compilation serves every
    layer, the module tree and its state-dict names stay as they were, and the chunked output head
    (``OutputHead``) keeps working and compiles its per-chunk loss too. Every forward but decoding takes the compiled
    path (training, reference and log-prob passes, and GRPO's training pass over a group's shared prompt cache);
    decoding (a KV cache extended without gradients, its length growing every step) stays with the generation
    engine's own choice. A backend that cannot start leaves the model eager with a warning, and a block
    that fails to compile runs eagerly (``_eager_on_compile_error``). A model without a stack of blocks is compiled
    whole (``compile_model``)."""
    if not enabled:
        return model
    use_persistent_compile_cache()
    try:
        blocks = _decoder_blocks(model)
    except RLHFInputError:
        return compile_model(model, True, backend)
    try:
        for block in blocks:
            block.forward = _CompiledBlockForward(block.forward, backend)
    except Exception as err:  # backend missing, unsupported platform: training must go on
        for block in blocks:
            block.__dict__.pop("forward", None)
        logger.warning("torch.compile failed (%s); continuing without compilation", str(err).splitlines()[0])
        return model
    innermost_model(model)._rlhf_compiled_step = True  # read by OutputHead: compile the per-chunk loss too
    logger.info("torch_compile: %d decoder blocks compiled (backend=%s), and the output head's loss", len(blocks),
                backend)
    return model


class _CompiledBlockForward:
    """A block's forward that runs eagerly when it extends a KV cache without gradients (decoding) and compiled
    otherwise; what ``compile_training_step`` puts on each block."""

    def __init__(self, forward: Callable[..., Any], backend: str) -> None:
        # dynamic shapes from the start: batches differ in length (and DPO's packed rows in layout), which would
        # otherwise compile a static graph per shape until dynamo gives up on it
        self.eager = forward
        self.compiled = _eager_on_compile_error(torch.compile(forward, backend=backend, dynamic=True))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cached = any(kwargs.get(name) is not None for name in ("cache", "past_key_values", "past_key_value"))
        decoding = cached and not torch.is_grad_enabled()
        return self.eager(*args, **kwargs) if decoding else self.compiled(*args, **kwargs)


def _eager_on_compile_error(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` with dynamo's ``suppress_errors`` on for the length of each call (a frame that fails to compile
    runs eagerly) and the process's own value restored after it."""
    import torch._dynamo

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(suppress_errors=True):
            return forward(*args, **kwargs)

    return call


# ==== 3. Data ====
# Files of any supported format become canonical records:
#   {"system": str, "messages": [{"role": "user"|"assistant", "content": str}, ...]   (the prompt, ending with user)
#    + "response" (sft, kto) | "chosen", "rejected" (preference) | "label" (kto) | "answer", "verifiable" (prompt)
#    + "location": "file:line"}
# Every error names the record's file:line so the user can fix it in an editor.

RECORD_KINDS = ("sft", "preference", "kto", "prompt")
READABLE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": "history",
                  "system": "system", "chosen": "chosen", "rejected": "rejected", "kto_tag": "kto_tag",
                  "answer": "answer", "verifiable": "verifiable"}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "chosen": "chosen", "rejected": "rejected",
                    "kto_tag": "kto_tag", "answer": "answer", "verifiable": "verifiable", "tools": "tools"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
               "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system"}


@dataclass
class DatasetSpec:
    """One dataset to read: its files and, when registered in dataset_info.json, how to read them."""

    name: str
    files: list[Path] = field(default_factory=list)
    formatting: str = "auto"  # alpaca | sharegpt | auto (decided per record from its keys)
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    ranking: bool = False
    hub: dict[str, Any] | None = None  # hf_hub_url entries: loaded with datasets.load_dataset
    hf_dir: Path | None = None  # a directory written by Dataset.save_to_disk
    media_dir: Path | None = None  # where relative image paths are found (media_dir, else dataset_dir)


def _files_in(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in READABLE_SUFFIXES)


def resolve_dataset(name: str, dataset_dir: str | os.PathLike) -> DatasetSpec:
    """A path to a file/directory, or a name registered in ``dataset_dir/dataset_info.json``."""
    name = name.strip()
    as_path = Path(name)
    for candidate in (as_path, Path(dataset_dir) / name):
        if candidate.exists():
            if candidate.is_dir() and ((candidate / "dataset_info.json").exists()
                                       and (candidate / "state.json").exists()
                                       or (candidate / "dataset_dict.json").exists()):
                return DatasetSpec(name=name, hf_dir=candidate)
            files = _files_in(candidate)
            if not files:
                raise RLHFInputError(f"dataset '{name}': {candidate} holds no {'/'.join(READABLE_SUFFIXES)} files")
            if candidate.is_file() and candidate.suffix not in READABLE_SUFFIXES:
                raise RLHFInputError(f"dataset '{name}': unsupported file type '{candidate.suffix}'; "
                                     f"use {', '.join(READABLE_SUFFIXES)}")
            return DatasetSpec(name=name, files=files)
    if as_path.suffix in (*READABLE_SUFFIXES, ".txt") or "/" in name or "\\" in name:  # a path, not a registered name
        raise RLHFInputError(f"dataset file {name} does not exist (nor {Path(dataset_dir) / name}); check the path "
                             f"and the working directory {os.getcwd()}")
    info_path = Path(dataset_dir) / "dataset_info.json"
    if not info_path.exists():
        raise RLHFInputError(f"dataset '{name}' is neither a file nor registered: {info_path} does not exist "
                             f"(set dataset_dir, or pass a path to a JSON/JSONL/Parquet file)")
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RLHFInputError(f"{info_path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(info, dict):
        raise RLHFInputError(f"{info_path} must be a JSON object of name: entry (LLaMA-Factory's layout), "
                             f"not a {type(info).__name__}")
    if name not in info:
        raise RLHFInputError(f"dataset '{name}' is not in {info_path}; "
                             f"{_where_registered(name, Path(dataset_dir), info)}")
    entry = info[name]
    _check_dataset_entry(info_path, name, entry)
    spec = DatasetSpec(name=name, formatting=entry.get("formatting", "alpaca"), columns=entry.get("columns", {}),
                       tags=entry.get("tags", {}), ranking=bool(entry.get("ranking", False)))
    if "file_name" in entry:
        target = Path(dataset_dir) / entry["file_name"]
        if not target.exists():
            raise RLHFInputError(f"{info_path}: dataset '{name}' names {target}, which does not exist")
        spec.files = _files_in(target)
    elif "hf_hub_url" in entry:
        spec.hub = {"path": entry["hf_hub_url"], "name": entry.get("subset"), "split": entry.get("split", "train"),
                    "data_dir": entry.get("folder")}
    else:
        raise RLHFInputError(f"{info_path}: dataset '{name}' has no file_name or hf_hub_url")
    return spec


def _where_registered(name: str, dataset_dir: Path, info: dict[str, Any]) -> str:
    """The fix for a name missing from dataset_dir's registry: a folder below that registers it (the demo's names
    live in data/demo), else the closest registered name."""
    for nested in sorted(dataset_dir.glob("*/dataset_info.json")):
        with contextlib.suppress(OSError, ValueError):
            if name in json.loads(nested.read_text(encoding="utf-8")):
                return f"{nested} registers it: set dataset_dir={nested.parent}"
    hint = difflib.get_close_matches(name, list(info), n=1)
    return f"did you mean '{hint[0]}'?" if hint else "register it there, or give a file path"


DATASET_INFO_KEYS = ("file_name", "hf_hub_url", "formatting", "ranking", "subset", "split", "folder", "columns", "tags")
DATASET_INFO_UNSUPPORTED = {  # LLaMA-Factory keys this loader cannot honour, and what to do instead
    "ms_hub_url": "ModelScope is not supported; download the files and use file_name",
    "om_hub_url": "Modelers is not supported; download the files and use file_name",
    "script_url": "dataset loading scripts are not supported; use file_name or hf_hub_url",
    "cloud_file_name": "cloud storage is not supported; copy the file here and use file_name",
    "num_samples": "per-dataset sampling is not supported; use the config field max_samples",
}
DATASET_COLUMNS = {"alpaca": (*ALPACA_COLUMNS, "margin", "images"), "sharegpt": (*SHAREGPT_COLUMNS, "margin", "images")}
MULTIMODAL_COLUMNS = ("videos", "audios")  # LLaMA-Factory's other media: not supported (images are)


def _check_dataset_entry(info_path: Path, name: str, entry: Any) -> None:
    """Every key of a dataset_info.json entry is one this loader honours: a misspelt key ('colums') would
    otherwise be skipped and the defaults read the file, wrongly or not at all."""
    def fail(key: str, problem: str) -> None:
        raise RLHFInputError(f"{info_path}:{_key_line(info_path, name, key)}: dataset '{name}': {problem}")

    def did_you_mean(key: str, valid: Iterable[str]) -> str:
        hint = difflib.get_close_matches(key, list(valid), n=1)
        return f"did you mean '{hint[0]}'? " if hint else ""

    if not isinstance(entry, dict):
        fail(name, f"its entry must be an object like {{\"file_name\": \"data.json\"}}, not {type(entry).__name__}")
    for key in entry:
        if key in DATASET_INFO_UNSUPPORTED:
            fail(key, f"'{key}': {DATASET_INFO_UNSUPPORTED[key]}")
        if key not in DATASET_INFO_KEYS:
            fail(key, f"unknown key '{key}'; {did_you_mean(key, DATASET_INFO_KEYS)}valid: "
                      f"{', '.join(DATASET_INFO_KEYS)}")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in DATASET_COLUMNS:
        fail("formatting", f"formatting '{formatting}' is not alpaca or sharegpt; "
                           f"{did_you_mean(str(formatting), DATASET_COLUMNS)}")
    for group, valid in (("columns", DATASET_COLUMNS[formatting]), ("tags", tuple(SHAREGPT_TAGS))):
        mapping = entry.get(group, {})
        if not isinstance(mapping, dict):
            fail(group, f"'{group}' must be an object mapping names to your file's keys")
        for key in mapping:
            if group == "columns" and key in MULTIMODAL_COLUMNS:
                fail(key, f"column '{key}': {key} are not supported (images are); train on image or text records")
            if key not in valid:
                fail(key, f"unknown {group[:-1]} '{key}' for {formatting} data; {did_you_mean(key, valid)}valid: "
                          f"{', '.join(valid)}")
    if "tags" in entry and formatting != "sharegpt":
        fail("tags", "'tags' apply to sharegpt data only; set \"formatting\": \"sharegpt\" or remove them")


def _key_line(info_path: Path, name: str, key: str) -> int:
    """The line of ``key`` inside dataset ``name``'s entry (for file:line messages; 1 when it cannot be told)."""
    text = info_path.read_text(encoding="utf-8")
    start = text.find(json.dumps(name))
    at = text.find(json.dumps(key), start + 1) if start >= 0 and key != name else start
    return text.count("\n", 0, at) + 1 if at >= 0 else 1


def _line_starts(text: str) -> list[int]:
    return [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]


def _iter_json_file(path: Path) -> Iterator[tuple[str, Any]]:
    """Records of a JSON array (or a single object) with the line each starts on. Strict, as json.load
    is: a missing or trailing comma and anything after the first value (often JSONL saved as .json)
    are errors naming the line, never records silently dropped."""

    text = _decode_utf8(path.read_bytes(), path)
    starts = _line_starts(text)
    decoder = json.JSONDecoder()

    def line_of(position: int) -> int:
        return bisect.bisect_right(starts, position)

    def skip_space(position: int) -> int:
        while position < len(text) and text[position] in " \t\r\n":
            position += 1
        return position

    def refuse_extra_data(position: int) -> None:
        if skip_space(position) < len(text):
            raise RLHFInputError(f"{path}:{line_of(skip_space(position))}: extra data after the file's first JSON "
                                 "value; a .json file holds one array of records (one object per line is .jsonl: "
                                 "rename it)")

    pos = skip_space(0)
    if pos >= len(text):
        return
    try:
        if text[pos] != "[":
            obj, end = decoder.raw_decode(text, pos)
            refuse_extra_data(end)
            yield f"{path}:{line_of(pos)}", obj
            return
        pos = skip_space(pos + 1)
        if pos < len(text) and text[pos] == "]":
            refuse_extra_data(pos + 1)
            return
        while True:
            obj, end = decoder.raw_decode(text, pos)
            yield f"{path}:{line_of(pos)}", obj
            pos = skip_space(end)
            if pos < len(text) and text[pos] == "]":
                refuse_extra_data(pos + 1)
                return
            if pos >= len(text) or text[pos] != ",":
                where = "end of file" if pos >= len(text) else repr(text[pos])
                raise RLHFInputError(f"{path}:{line_of(min(pos, len(text) - 1))}: invalid JSON (expected ',' or ']' "
                                     f"after a record, found {where})")
            pos = skip_space(pos + 1)
            if pos < len(text) and text[pos] == "]":
                raise RLHFInputError(f"{path}:{line_of(pos)}: invalid JSON (a comma before ']'); remove it")
    except json.JSONDecodeError as err:
        raise RLHFInputError(f"{path}:{err.lineno}: invalid JSON ({err.msg}; column {err.colno})") from None


def _decode_utf8(data: bytes, path: Path, first_line: int = 1) -> str:
    """UTF-8 text (a leading byte-order mark is dropped), or an error naming the line of the bad byte."""
    try:
        return data.decode("utf-8-sig" if first_line == 1 else "utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data[:err.start].count(b"\n")
        raise RLHFInputError(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x}); "
                             f"re-save the file as UTF-8") from None


def _iter_jsonl_file(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as handle:
        for number, raw_line in enumerate(handle, 1):
            line = _decode_utf8(raw_line, path, number)
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as err:
                raise RLHFInputError(f"{path}:{number}: invalid JSON ({err.msg}; column {err.colno}); "
                                     f"each line of a .jsonl file must be one JSON object") from None


def _iter_table(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".csv":
        yield from _iter_csv_file(path)
        return
    from datasets import Dataset

    for index, row in enumerate(Dataset.from_parquet(str(path))):
        yield f"{path}:row {index + 1}", row


def _iter_csv_file(path: Path) -> Iterator[tuple[str, Any]]:
    """CSV rows with the line each starts on. Every cell is text, as CSV has no types: a response '2' stays
    the string '2' (a type-guessing reader made it an int the record check then refused); an empty cell
    is a missing value."""

    reader = csv.reader(io.StringIO(_decode_utf8(path.read_bytes(), path), newline=""))
    try:
        header = next(reader, None)
        while header is not None:
            start = reader.line_num + 1  # a quoted cell may span lines: the record's first line
            row = next(reader, None)
            if row is None:
                return
            if not any(cell.strip() for cell in row):
                continue
            if len(row) > len(header):
                raise RLHFInputError(f"{path}:{start}: {len(row)} cells but the header has {len(header)} columns")
            yield f"{path}:{start}", {key: (row[i] if i < len(row) and row[i] != "" else None)
                                      for i, key in enumerate(header)}
    except csv.Error as err:
        raise RLHFInputError(f"{path}:{reader.line_num}: invalid CSV ({err})") from None


def iter_raw_records(spec: DatasetSpec) -> Iterator[tuple[str, Any]]:
    """(location, raw record) pairs in file order."""
    if spec.hf_dir is not None:
        from datasets import load_from_disk

        data = load_from_disk(str(spec.hf_dir))
        if hasattr(data, "keys"):  # a DatasetDict: use its train split
            data = data["train"] if "train" in data else next(iter(data.values()))
        for index, row in enumerate(data):
            yield f"{spec.hf_dir}:row {index + 1}", row
        return
    if spec.hub is not None:
        from datasets import load_dataset

        try:
            data = load_dataset(**{k: v for k, v in spec.hub.items() if v is not None})
        except Exception as err:
            raise RLHFInputError(f"dataset '{spec.name}': could not load {spec.hub['path']} from the Hub "
                                 f"({str(err).splitlines()[0]}); download it and register a file_name "
                                 "instead") from None
        for index, row in enumerate(data):
            yield f"{spec.hub['path']}:row {index + 1}", row
        return
    for path in spec.files:
        reader = {".json": _iter_json_file, ".jsonl": _iter_jsonl_file}.get(path.suffix, _iter_table)
        try:
            yield from reader(path)
        except UnicodeDecodeError as err:  # CSV read by datasets
            raise RLHFInputError(f"{path}: not UTF-8 text (bad byte at offset {err.start}); re-save the file as "
                                 "UTF-8") from None
        except RLHFInputError:
            raise
        except Exception as err:  # pyarrow / datasets parse errors on a corrupt Parquet or CSV file
            if path.suffix not in (".parquet", ".csv"):
                raise
            raise RLHFInputError(f"{path}: cannot read this {path.suffix} file "
                                 f"({str(err).splitlines()[0][:120]})") from None


def _text(raw: dict[str, Any], key: str | None, location: str, required: bool = False) -> str | None:
    """A string field, or a clear error naming it."""
    if key is None or key not in raw or raw[key] is None:
        if required:
            raise RLHFInputError(f"{location}: record has no '{key}' field (it has: {', '.join(map(str, raw))})")
        return None
    value = raw[key]
    if not isinstance(value, str):
        raise RLHFInputError(f"{location}: field '{key}' must be a string, got {type(value).__name__} ({value!r:.40})")
    return value


def _parse_label(value: Any, location: str, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "desirable", "good", "1", "yes"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "undesirable", "bad", "0", "no"):
        return False
    raise RLHFInputError(f"{location}: field '{key}' must be true/false (or desirable/undesirable), got {value!r:.40}")


def _parse_alpaca(raw: dict[str, Any], columns: dict[str, str], location: str) -> dict[str, Any]:
    cols = {**ALPACA_COLUMNS, **columns}
    if cols["prompt"] not in raw:
        raise RLHFInputError(f"{location}: record has no '{cols['prompt']}' field (it has: "
                             f"{', '.join(map(str, raw))}); name your keys in the dataset's dataset_info.json entry, "
                             "e.g. \"columns\": {\"prompt\": \"question\", \"response\": \"answer\"}")
    prompt = _text(raw, cols["prompt"], location, required=True)
    query = _text(raw, cols["query"], location)
    if query:
        prompt = f"{prompt}\n{query}" if prompt else query
    messages = []
    history = raw.get(cols["history"]) or []
    if not isinstance(history, list) or not all(isinstance(t, (list, tuple)) and len(t) == 2 for t in history):
        raise RLHFInputError(f"{location}: field '{cols['history']}' must be a list of [question, answer] pairs")
    for question, answer in history:
        messages += [{"role": "user", "content": str(question)}, {"role": "assistant", "content": str(answer)}]
    messages.append({"role": "user", "content": prompt})
    parsed = {"system": _text(raw, cols["system"], location) or "", "messages": messages,
              "response": _text(raw, cols["response"], location)}
    for key in ("chosen", "rejected"):
        parsed[key] = _text(raw, cols[key], location)
    return parsed


def _message_text(message: Any, tags: dict[str, str], location: str, what: str) -> str:
    if isinstance(message, str):
        return message
    if isinstance(message, dict) and tags["content_tag"] in message:
        content = message[tags["content_tag"]]
        if isinstance(content, str):
            return content
        raise RLHFInputError(f"{location}: {what} content must be a string, got {type(content).__name__}")
    raise RLHFInputError(f"{location}: {what} must be a message with '{tags['content_tag']}', got {message!r:.60}")


def _parse_sharegpt(raw: dict[str, Any], columns: dict[str, str], tags: dict[str, str],
                    location: str) -> dict[str, Any]:
    cols = {**SHAREGPT_COLUMNS, **columns}
    turns = raw.get(cols["messages"])
    if cols["messages"] not in raw:
        raise RLHFInputError(f"{location}: record has no '{cols['messages']}' field (it has: "
                             f"{', '.join(map(str, raw))}); name the conversation's key in the dataset's "
                             "dataset_info.json entry, e.g. \"columns\": {\"messages\": \"messages\"}")
    if not isinstance(turns, list):
        raise RLHFInputError(f"{location}: field '{cols['messages']}' must be a list of messages")
    if tags is None:  # not registered: tell ShareGPT ({from, value}) from OpenAI ({role, content})
        first = turns[0] if turns and isinstance(turns[0], dict) else {}
        tags = OPENAI_TAGS if "role" in first else SHAREGPT_TAGS
    tags = {**SHAREGPT_TAGS, **tags}
    roles = {tags["user_tag"]: "user", tags["observation_tag"]: "tool", tags["assistant_tag"]: "assistant",
             tags["function_tag"]: "function_call", tags["system_tag"]: "system"}
    system = _text(raw, cols["system"], location) or ""
    messages: list[dict[str, Any]] = []
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or tags["role_tag"] not in turn:
            raise RLHFInputError(f"{location}: message {number} has no '{tags['role_tag']}' key")
        role = roles.get(turn[tags["role_tag"]])
        if role is None:
            raise RLHFInputError(f"{location}: message {number} has role {turn[tags['role_tag']]!r}; "
                                 f"expected one of {', '.join(roles)} (set 'tags' in dataset_info.json)")
        content = _message_text(turn, tags, location, f"message {number}")
        if role == "system":
            system = content
            continue
        # LLaMA-Factory's order: user or tool result, then assistant or function call, in turn
        side = "user" if role in ("user", "tool") else "assistant"
        expected = "user" if len(messages) % 2 == 0 else "assistant"
        if side != expected:
            raise RLHFInputError(f"{location}: messages must alternate user/assistant; message {number} is "
                                 f"'{role}' where '{expected}' was expected")
        messages.append(_tool_call_message(content, location, number) if role == "function_call"
                        else {"role": role, "content": content})
    _link_tool_results(messages)
    parsed = {"system": system, "messages": messages, "response": None}
    if messages and messages[-1]["role"] == "assistant":
        last = messages.pop()
        parsed["response"] = last["content"] or json.dumps([c["function"] for c in last["tool_calls"]])
        if last.get("tool_calls"):
            parsed["response_message"] = last
    if raw.get(cols["tools"]) not in (None, "", []):
        parsed["tools"] = _parse_tools(raw[cols["tools"]], location, cols["tools"])
    for key in ("chosen", "rejected"):
        value = raw.get(cols[key])
        parsed[key] = None if value is None else _message_text(value, tags, location, key)
    return parsed


def _tool_call_message(content: str, location: str, number: int) -> dict[str, Any]:
    """An assistant message calling tools, from LLaMA-Factory's function_call turn: a JSON object (or list) of
    {"name", "arguments"}. Each call gets an id (9 letters and digits, which Mistral's templates require)."""
    try:
        calls = json.loads(content)
    except json.JSONDecodeError as err:
        raise RLHFInputError(f"{location}: message {number} (a function call) is not JSON ({err.msg}); write it as "
                             f'{{"name": ..., "arguments": {{...}}}}') from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls):
        raise RLHFInputError(f"{location}: message {number} (a function call) must hold \"name\" and \"arguments\" "
                             f"for each call")
    digest = hashlib.sha256(f"{location}:{number}".encode()).hexdigest()
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"{digest[9 * i:9 * i + 9]}", "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}} for i, c in enumerate(calls[:7])]}


def _link_tool_results(messages: list[dict[str, Any]]) -> None:
    """Give each tool result the id of the call it answers (the calls of the assistant turn before it, in
    order), as chat templates that pair them expect."""
    pending: list[str] = []
    for message in messages:
        if message.get("tool_calls"):
            pending = [call["id"] for call in message["tool_calls"]]
        elif message["role"] == "tool":
            message["tool_call_id"] = pending.pop(0) if pending else ""


def _parse_tools(value: Any, location: str, key: str) -> list[dict[str, Any]]:
    """The tools a record offers (LLaMA-Factory's ``tools`` column: a JSON list of function schemas), in the
    form chat templates take: ``[{"type": "function", "function": {name, description, parameters}}]``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RLHFInputError(f"{location}: field '{key}' is not JSON ({err.msg})") from None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not all(isinstance(t, dict) and ("name" in t or "function" in t) for t in value):
        raise RLHFInputError(f"{location}: field '{key}' must be a list of function schemas with a 'name'")
    return [t if "function" in t else {"type": "function", "function": t} for t in value]


def _parse_canonical(raw: dict[str, Any], location: str) -> dict[str, Any]:
    """Seed 003's contracts ({prompt, response|chosen/rejected|label|answer}) and seed 004's {document, target}.
    ``prompt`` may also be a list of chat messages (TRL's conversational format)."""
    if "document" in raw and "prompt" not in raw:
        raw = {**raw, "prompt": raw["document"], "response": raw.get("target")}
    if "completion" in raw and "response" not in raw:  # TRL's prompt-completion format
        raw = {**raw, "response": raw["completion"]}
    prompt = raw.get("prompt")
    if isinstance(prompt, list):
        parsed = _parse_sharegpt({"messages": prompt}, {"messages": "messages"}, OPENAI_TAGS, location)
        messages = parsed["messages"] + ([{"role": "assistant", "content": parsed["response"]}] if parsed["response"]
                                         else [])
        system = parsed["system"]
    else:
        messages = [{"role": "user", "content": _text(raw, "prompt", location, required=True)}]
        system = _text(raw, "system", location) or ""
    parsed = {"system": system, "messages": messages}
    for key in STEP_LABEL_KEYS:
        if raw.get(key) is not None:
            parsed[key] = raw[key]
    for key in ("response", "chosen", "rejected"):
        value = raw.get(key)
        if isinstance(value, list):  # conversational completion: the assistant message(s)
            value = "".join(_message_text(m, OPENAI_TAGS, location, key) for m in value)
            raw = {**raw, key: value}
        parsed[key] = _text(raw, key, location)
    return parsed


STEP_LABEL_KEYS = ("chosen_step_labels", "rejected_step_labels")  # optional per-step correctness (process rewards)


def _step_labels(value: Any, location: str, key: str) -> list[bool | None]:
    if not isinstance(value, list) or not all(v is None or isinstance(v, (bool, int)) for v in value):
        raise RLHFInputError(f"{location}: '{key}' must be a list of true/false/null, one per reasoning step")
    return [None if v is None else bool(v) for v in value]


def _detect_format(raw: Any, location: str) -> str:
    if isinstance(raw, str):
        return "text"
    if not isinstance(raw, dict):
        raise RLHFInputError(f"{location}: a record must be a JSON object or a string, got {type(raw).__name__}")
    if "messages" in raw or "conversations" in raw:
        return "sharegpt"
    if "instruction" in raw:
        return "alpaca"
    if "prompt" in raw or "document" in raw:
        return "canonical"
    raise RLHFInputError(
        f"{location}: unknown record format (keys: {', '.join(map(str, raw)) or 'none'}); expected prompt/response, "
        "prompt/chosen/rejected, prompt/response/label, instruction/input/output (alpaca), messages or "
        "conversations (OpenAI/ShareGPT), or document/target; register other column names in dataset_info.json")


def parse_record(raw: Any, spec: DatasetSpec, location: str) -> dict[str, Any]:
    """One raw record of any supported format -> the shared parsed form (prompt, completions, labels)."""
    formatting = spec.formatting if spec.formatting != "auto" else _detect_format(raw, location)
    if formatting != "text" and not isinstance(raw, dict):
        raise RLHFInputError(f"{location}: a record must be a JSON object, got {type(raw).__name__}")
    if formatting == "text":
        parsed = {"system": "", "messages": [{"role": "user", "content": raw}], "response": None,
                  "chosen": None, "rejected": None}
        raw = {}
    elif formatting == "alpaca":
        parsed = _parse_alpaca(raw, spec.columns, location)
    elif formatting == "sharegpt":
        columns = spec.columns
        if "messages" not in columns and "conversations" not in raw and "messages" in raw:
            columns = {**columns, "messages": "messages"}  # OpenAI layout: {"messages": [{role, content}]}
        parsed = _parse_sharegpt(raw, columns, spec.tags or None, location)
    elif formatting == "canonical":
        parsed = _parse_canonical(raw, location)
    else:
        raise RLHFInputError(f"dataset '{spec.name}': formatting '{formatting}' is not alpaca or sharegpt")
    label_key = spec.columns.get("kto_tag") or next((k for k in ("label", "kto_tag") if k in raw), None)
    parsed["label"] = _parse_label(raw[label_key], location, label_key) if label_key and label_key in raw else None
    answer_key = spec.columns.get("answer", "answer")
    answer = raw.get(answer_key)
    parsed["answer"] = None if answer is None else str(answer)
    verifiable_key = spec.columns.get("verifiable", "verifiable")
    verifiable = raw.get(verifiable_key)
    parsed["verifiable"] = (answer is not None if verifiable is None  # "false" (CSV, JSON strings) means false
                            else _parse_label(verifiable, location, verifiable_key))
    margin_key = spec.columns.get("margin", "margin")
    parsed["margin"] = _parse_margin(raw.get(margin_key), location, margin_key)
    for media in MULTIMODAL_COLUMNS:
        if raw.get(media) not in (None, "", []):
            raise RLHFInputError(f"{location}: field '{media}': {media} are not supported (images are); remove them")
    images_key = spec.columns.get("images", "images")
    parsed["images"] = _image_paths(raw.get(images_key), spec, location, images_key)
    return parsed


def _image_paths(value: Any, spec: DatasetSpec, location: str, key: str) -> list[str]:
    """A record's image paths (LLaMA-Factory's ``images`` column: a list of paths, or one path), each resolved
    against media_dir / dataset_dir when it is not found as given."""
    if value in (None, "", []):
        return []
    entries = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(entries, list):
        raise RLHFInputError(f"{location}: field '{key}' must be a list of image paths, got {type(value).__name__}")
    paths = []
    for entry in entries:
        path = entry.get("path") if isinstance(entry, dict) else entry
        if not isinstance(path, str) or not path:
            raise RLHFInputError(f"{location}: field '{key}' must list image file paths (relative to dataset_dir), "
                                 f"got {entry!r:.60}")
        base = spec.media_dir or (spec.files[0].parent if spec.files else Path("."))
        candidate = Path(path).expanduser()
        paths.append(str(candidate if candidate.is_absolute() else base / candidate))
    return paths


IMAGE_PLACEHOLDER = "<image>"  # where each of a record's images sits in its text (section 5 expands it)


def count_placeholders(record: dict[str, Any]) -> int:
    texts = [m.get("content") or "" for m in record.get("messages", [])]
    texts += [record.get(key) or "" for key in ("response", "chosen", "rejected")]
    return sum(text.count(IMAGE_PLACEHOLDER) for text in texts if isinstance(text, str))


def open_image(path: str, location: str = "record", check_only: bool = False) -> Any:
    """An image file as an RGB PIL image; a missing or unreadable file is one line naming the record.
    ``check_only``: read the header and check the file's structure, decode nothing (loading data), return None."""
    from PIL import Image, UnidentifiedImageError

    if not Path(path).is_file():
        raise RLHFInputError(f"{location}: image '{path}' does not exist (image paths are relative to dataset_dir, "
                             f"or to media_dir when set)")
    try:
        with Image.open(path) as image:
            if check_only:
                image.verify()
                return None
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise RLHFInputError(f"{location}: '{path}' is not a readable image ({_one_line(err)}); give a PNG, JPEG, "
                             f"WebP or another format PIL opens") from None


def _check_images(parsed: dict[str, Any], location: str) -> None:
    """One image per <image> placeholder, each a readable image file (LLaMA-Factory's rule)."""
    images, placeholders = parsed.get("images") or [], count_placeholders(parsed)
    if placeholders != len(images):
        raise RLHFInputError(f"{location}: the text has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but the "
                             f"record has {len(images)} image(s); put one {IMAGE_PLACEHOLDER} where each image belongs")
    for path in images:
        open_image(path, location, check_only=True)


def _parse_margin(value: Any, location: str, key: str) -> float | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        margin = float(value)
    except (TypeError, ValueError):
        raise RLHFInputError(f"{location}: field '{key}' must be a number, got {value!r:.40}") from None
    if not math.isfinite(margin):
        raise RLHFInputError(f"{location}: field '{key}' must be a finite number, got {value!r:.40}")
    return margin


def to_record(parsed: dict[str, Any], kind: str, location: str) -> dict[str, Any]:
    """Check that a parsed record has what ``kind`` needs and return the canonical record."""
    def need(key: str, what: str) -> str:
        value = parsed.get(key)
        if value is None:
            raise RLHFInputError(f"{location}: record has no {what}; a {kind} record needs it")
        if not value.strip():
            raise RLHFInputError(f"{location}: {what} is empty; fix or remove the record (or set "
                                 "skip_invalid_records=true)")
        return value

    if not parsed["messages"] or not parsed["messages"][-1]["content"].strip():
        raise RLHFInputError(f"{location}: the prompt is empty")
    if kind == "kto" and parsed.get("response_message"):
        raise RLHFInputError(f"{location}: the answer is a function call; KTO records answer in text (tool calls "
                             f"may come earlier in the conversation), SFT records may end with one")
    record = {"system": parsed["system"], "messages": parsed["messages"], "location": location}
    if parsed.get("images") or count_placeholders(parsed):
        _check_images(parsed, location)
        record["images"] = parsed["images"]
    if parsed.get("tools"):
        record["tools"] = parsed["tools"]
    if kind == "sft":
        record["response"] = need("response", "response (completion)")
        if parsed.get("response_message"):  # the answer is a call of the tools: rendered by the template as one
            record["response_message"] = parsed["response_message"]
    elif kind == "preference":
        record["chosen"] = need("chosen", "'chosen' response")
        record["rejected"] = need("rejected", "'rejected' response")
        if parsed.get("margin") is not None:  # TRL's optional per-pair margin for the reward-model loss
            record["margin"] = float(parsed["margin"])
        for key in STEP_LABEL_KEYS:
            if parsed.get(key) is not None:
                record[key] = _step_labels(parsed[key], location, key)
    elif kind == "kto":
        record["response"] = need("response", "response (completion)")
        if parsed["label"] is None:
            raise RLHFInputError(f"{location}: record has no 'label' (or kto_tag); KTO needs true/false per response")
        record["label"] = parsed["label"]
    elif kind == "prompt":
        record["answer"], record["verifiable"] = parsed["answer"], parsed["verifiable"]
    else:
        raise ValueError(f"kind must be one of {RECORD_KINDS}")
    return record


def load_records(dataset: str, dataset_dir: str | os.PathLike, kind: str, *, max_samples: int | None = None,
                 skip_invalid: bool = False, media_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Read every dataset named in ``dataset`` (comma-separated) into canonical records of ``kind``.

    Malformed records stop the run with a file:line error, unless ``skip_invalid`` — then they are
    skipped, counted and the first few locations reported: nothing is dropped silently.
    """
    if not dataset.strip():
        raise RLHFInputError("config field 'dataset' is empty; name a dataset or a data file")
    records: list[dict[str, Any]] = []
    for name in [n for n in dataset.split(",") if n.strip()]:
        spec = resolve_dataset(name, dataset_dir)
        spec.media_dir = Path(media_dir or dataset_dir)
        skipped: list[str] = []
        ties: list[str] = []
        taken = 0
        for location, raw in iter_raw_records(spec):
            if max_samples is not None and taken >= max_samples:
                break
            try:
                record = to_record(parse_record(raw, spec, location), kind, location)
            except RLHFInputError as err:
                if not skip_invalid:
                    raise
                skipped.append(str(err))
                continue
            if kind == "preference" and record["chosen"].strip() == record["rejected"].strip():
                ties.append(location)  # no preference to learn: every pairwise loss has zero gradient on it
                continue
            records.append(record)
            taken += 1
        if skipped:
            logger.warning("dataset '%s': skipped %d invalid records, e.g. %s", name, len(skipped),
                           "; ".join(skipped[:3]))
        if ties:
            logger.warning("dataset '%s': skipped %d pairs whose chosen and rejected responses are the same, e.g. %s",
                           name, len(ties), ", ".join(ties[:3]))
        if taken == 0:
            raise RLHFInputError(f"dataset '{name}' has no usable {kind} records")
        logger.info("dataset '%s': %d %s records", name, taken, kind)
    return records


ANSWER_PATTERN = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")


def extract_answer(text: str) -> str | None:
    """The number after the last ``Answer:`` in a response (the demo task's verifiable format)."""
    found = ANSWER_PATTERN.findall(text)
    return found[-1] if found else None


# -- chat templates: rendered by tokenizer.apply_chat_template with the Jinja source below. Names are LLaMA-Factory's;
# each renders what its family's own template renders for system / user / assistant turns (tests compare them with
# the real templates), so that a model trained with the name and served with its own template sees the same text.

_SYSTEM_FIRST = ("{%- if messages and messages[0]['role'] == 'system' %}"
                 "{%- set system_message = messages[0]['content'] %}"
                 "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}")
_QWEN_TOOLS = (  # Qwen2.5 / Qwen3 (Hermes-style): the tool schemas in the system turn, calls and results in XML tags
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>\\n\\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}")
_QWEN3_TOOL_CALL = ("{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
                    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
                    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
                    "{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}")
_QWEN25_TOOL_CALL = ("{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
                     "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
                     "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}")
_QWEN_TOOL_RESULT = ("{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}"
                     "{%- endif %}{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
                     "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}"
                     "{%- endif %}")
_QWEN3_ASSISTANT = (  # Qwen3: reasoning shown only after the last user query; the final turn always gets a block
    "{%- set content = message['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] or [] %}{%- if (loop.first and content) or not loop.first %}"
    "{{- '\\n' }}{%- endif %}" + _QWEN3_TOOL_CALL + "{%- endfor %}{{- '<|im_end|>\\n' }}")
_QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

@dataclass(frozen=True)
class ChatTemplate:
    """A built-in chat template: everything the code knows of it, in one record (LLaMA-Factory's
    ``register_template``). Adding a template is one ``register_template(ChatTemplate(...))`` below and a test
    that it renders what the model family's own template renders (tests/real_models.py, tests/test_vision.py).

    Args:
        name: the ``template:`` value that picks it.
        jinja: the template, rendered by the tokenizer's ``apply_chat_template``.
        special_tokens: markers it writes that the tokenizer must hold as single tokens, else the model would
            spell its stop marker in pieces and never learn to stop (ChatFormatter refuses such a pair).
        needs: tokenizer attributes it reads (``bos_token``, ``eos_token``), which must be set.
        end_marker: the text that ends an assistant turn, a stop token of generation (None: EOS ends it); one of
            inference_optimizations' END_MARKERS, which finds the same markers in a tokenizer's own template.
        tools: what of a tool-use record it writes, of "tools", "tool calls" and "tool results" (a record with
            something it does not write is an error, not a silent loss).
        thinking: it has Qwen3's ``enable_thinking`` switch."""

    name: str
    jinja: str
    special_tokens: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    end_marker: str | None = None
    tools: tuple[str, ...] = ()
    thinking: bool = False


TEMPLATES: dict[str, ChatTemplate] = {}  # name -> record, in registration order


def register_template(template: ChatTemplate) -> ChatTemplate:
    TEMPLATES[template.name] = template
    return template


_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
register_template(ChatTemplate("default", (  # LLaMA-Factory's "default": plain Human/Assistant turns
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ 'System: ' + message['content'] + '\\n' }}"
        "{% elif message['role'] == 'user' %}{{ 'Human: ' + message['content'] + '\\n' }}"
        "{% else %}{{ 'Assistant: ' + message['content'] + (eos_token or '') + '\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")))

register_template(ChatTemplate("empty", (  # LLaMA-Factory's "empty": the turns' text one after another, for base models
        "{% for message in messages %}{{ message['content'] }}{% endfor %}")))

register_template(ChatTemplate("chatml", (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    special_tokens=_CHATML_TOKENS, end_marker="<|im_end|>", tools=("tool results",)))

register_template(ChatTemplate("qwen", (  # Qwen2.5: ChatML with Qwen's default system prompt; tools in the system turn
        "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
        "{%- if tools %}{{- '<|im_start|>system\\n' + (messages[0]['content'] if has_system else '"
        + _QWEN_DEFAULT_SYSTEM + "') + '\\n\\n' }}" + _QWEN_TOOLS +
        "{%- elif has_system %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>system\\n" + _QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}{%- if message['role'] == 'system' and loop.first %}"
        "{%- elif message['role'] == 'tool' %}" + _QWEN_TOOL_RESULT +
        "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}{{- '<|im_start|>assistant' }}"
        "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
        "{%- for tool_call in message['tool_calls'] %}" + _QWEN25_TOOL_CALL + "{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
    special_tokens=_CHATML_TOKENS, end_marker="<|im_end|>", tools=("tools", "tool calls", "tool results")))

register_template(ChatTemplate("qwen3", (  # Qwen3 (thinking models); enable_thinking=false puts an empty
        # reasoning block in the prompt
        "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
        "{%- if tools %}{{- '<|im_start|>system\\n' + (messages[0]['content'] + '\\n\\n' if has_system else '') }}"
        + _QWEN_TOOLS +
        "{%- elif has_system %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- set ns = namespace(last_query=messages|length - 1) %}"
        "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}"
        "{%- endif %}{%- endfor %}"
        "{%- for message in messages %}{%- if message['role'] == 'system' and loop.first %}"
        "{%- elif message['role'] == 'assistant' %}" + _QWEN3_ASSISTANT +
        "{%- elif message['role'] == 'tool' %}" + _QWEN_TOOL_RESULT +
        "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}"
        "{%- endif %}"),
    special_tokens=(*_CHATML_TOKENS, "<think>", "</think>"), end_marker="<|im_end|>",
    tools=("tools", "tool calls", "tool results"), thinking=True))

register_template(ChatTemplate("qwen3_nothink", (  # Qwen3 instruct models without a reasoning mode (2507): plain
        # ChatML, no default system
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
    special_tokens=_CHATML_TOKENS, end_marker="<|im_end|>", tools=("tool results",)))

register_template(ChatTemplate("llama3", (  # Llama 3 Instruct
        "{%- for message in messages %}{%- if loop.first %}{{- bos_token }}{%- endif %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
        "message['content'] | trim + '<|eot_id|>' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{%- endif %}"),
    special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), needs=("bos_token",),
    end_marker="<|eot_id|>"))

register_template(ChatTemplate("llama2", (  # Llama 2 chat: the system prompt in <<SYS>> inside the first [INST]; no
        # generation header
        _SYSTEM_FIRST + "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
        "{%- set content = message['content'] %}{%- if loop.first and system_message is defined %}"
        "{%- set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + content %}{%- endif %}"
        "{{- bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{%- else %}{{- ' ' + message['content'].strip() + ' ' + eos_token }}{%- endif %}{%- endfor %}"),
    needs=("bos_token", "eos_token")))

register_template(ChatTemplate("mistral", (  # Mistral v0.3 (SentencePiece): the system prompt joins the last user
        # turn, as mistral-common does
        _SYSTEM_FIRST + "{%- set ns = namespace(last_user=-1) %}{%- for message in loop_messages %}"
        "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
        "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
        "{%- if loop.index0 == ns.last_user and system_message is defined %}"
        "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
        "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
        "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"),
    needs=("bos_token", "eos_token")))

register_template(ChatTemplate("gemma", (  # Gemma 2 / 3: turns of 'user' and 'model'; a system prompt opens the
        # first user turn
        _SYSTEM_FIRST + "{{- bos_token }}{%- for message in loop_messages %}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{- '<start_of_turn>' + role + '\\n' }}{%- if loop.first and system_message is defined %}"
        "{{- system_message + '\\n\\n' }}{%- endif %}{{- message['content'] | trim + '<end_of_turn>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"),
    special_tokens=("<start_of_turn>", "<end_of_turn>"), needs=("bos_token",), end_marker="<end_of_turn>",
    tools=("tool results",)))

register_template(ChatTemplate("phi", (  # Phi-3 / 3.5: the conversation ends with the end-of-text token
        "{%- for message in messages %}{%- if message['role'] != 'system' or message['content'] %}"
        "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}"),
    special_tokens=("<|user|>", "<|assistant|>", "<|end|>"), needs=("eos_token",), end_marker="<|end|>"))

register_template(dataclasses.replace(TEMPLATES["gemma"], name="gemma3"))
# Vision-language templates. Images arrive as text: each <image> placeholder has become the model's image tokens
# (VisionInputs.expand_record) before rendering, so these render string content. Each gives what the model's own
# processor template gives for the same conversation with {"type": "image"} parts (tests/test_vision.py).
register_template(ChatTemplate(  # Qwen2-VL / Qwen2.5-VL: ChatML with a default system prompt
    "qwen2_vl",
    "{%- if not messages or messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}" + TEMPLATES["chatml"].jinja,
    special_tokens=_CHATML_TOKENS, end_marker="<|im_end|>"))
register_template(ChatTemplate(  # Qwen3-VL Instruct: ChatML, no default system
    "qwen3_vl_nothink", TEMPLATES["qwen3_nothink"].jinja, special_tokens=_CHATML_TOKENS, end_marker="<|im_end|>"))
register_template(ChatTemplate(  # Qwen3-VL Thinking: the answer opens with <think>
    "qwen3_vl",
    TEMPLATES["qwen3"].jinja.replace(
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"),
    special_tokens=(*_CHATML_TOKENS, "<think>", "</think>"), end_marker="<|im_end|>"))
register_template(ChatTemplate(  # LLaVA-1.5 (llava-hf): 'USER: ' / 'ASSISTANT: ' turns; the end-of-sequence token
    # after each answer, which the processor's template leaves out (a model trained without it would never stop)
    "llava",
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{{- message['content'] + ' ' }}"
    "{%- elif message['role'] == 'user' %}{{- 'USER: ' + message['content'] + ' ' }}"
    "{%- else %}{{- 'ASSISTANT: ' + message['content'] + eos_token }}{%- if not loop.last %}{{- ' ' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}",
    needs=("eos_token",)))
# views of the records by name
CHAT_TEMPLATES: Mapping[str, str] = _RegistryColumn(TEMPLATES, "jinja")
TEMPLATE_SPECIAL_TOKENS: Mapping[str, tuple[str, ...]] = _RegistryColumn(TEMPLATES, "special_tokens")
_TURN_SENTINEL = "\ue000rlhf-turn\ue001"  # stands in for one turn's content to find where the template puts it


class ChatFormatter:
    """Turns canonical records into token ids and loss labels through a chat template.

    A conversation is rendered whole and encoded once, so the tokens are the ones ``apply_chat_template`` gives for
    it; the assistant turns are located in the rendered text and mapped to token positions
    (``encode_at_boundaries``). Encoding prompt and response apart would change tokens at the seam (a SentencePiece
    '\u2581' at the response's start). Labels are IGNORE_INDEX outside the trained turns unless ``train_on_prompt``.
    ``enable_thinking`` is passed to templates that have the switch (Qwen3's); ``generation_config`` adds the
    model's own stop tokens to the template's end-of-turn marker.
    """

    def __init__(self, tokenizer: Any, template: str = "auto", *, enable_thinking: bool | None = None,
                 generation_config: Any = None, vision: VisionInputs | None = None) -> None:
        self.tokenizer, self.vision = tokenizer, vision
        own = getattr(tokenizer, "chat_template", None)
        if template == "auto":
            self.name, self.source = ("tokenizer", own) if own else ("default", CHAT_TEMPLATES["default"])
        elif template in CHAT_TEMPLATES:
            self.name, self.source = template, CHAT_TEMPLATES[template]
            self._check_tokenizer_has_markers()
        else:
            hint = difflib.get_close_matches(template, list(CHAT_TEMPLATES), n=1)
            raise RLHFInputError(f"config field 'template' is '{template}', which is no template name"
                                 + (f"; did you mean '{hint[0]}'?" if hint else "")
                                 + f" valid: auto (the model's own), {', '.join(CHAT_TEMPLATES)}")
        self.template_kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            has_switch = TEMPLATES[self.name].thinking if self.name in TEMPLATES else "enable_thinking" in self.source
            if not has_switch:
                raise RLHFInputError(f"config field 'enable_thinking': chat template '{self.name}' has no thinking "
                                     f"switch; remove the field (or use a template that has one, such as qwen3)")
            self.template_kwargs["enable_thinking"] = bool(enable_thinking)
        self.stop_token_ids = self._stop_token_ids(generation_config)

    def _check_tokenizer_has_markers(self) -> None:
        record = TEMPLATES[self.name]
        missing = [marker for marker in record.special_tokens if not self._is_one_token(marker)]
        missing += [f"a {need}" for need in record.needs if getattr(self.tokenizer, need) is None]
        if missing:
            raise RLHFInputError(f"config field 'template': '{self.name}' writes {', '.join(missing)}, which this "
                                 f"tokenizer ({getattr(self.tokenizer, 'name_or_path', '')}) lacks as one token; the "
                                 "model would never learn to stop. Use the model's own template (template: auto) or "
                                 "the name of its family")

    def _is_one_token(self, marker: str) -> bool:
        token = self.tokenizer.convert_tokens_to_ids(marker)
        return (isinstance(token, int) and token != self.tokenizer.unk_token_id
                and self.encode(marker) == [token])

    def _stop_token_ids(self, generation_config: Any) -> list[int]:
        ids = list(stop_token_ids(self.tokenizer, generation_config))
        record = TEMPLATES.get(self.name)
        markers = [record.end_marker] if record is not None and record.end_marker else END_MARKERS
        for marker in markers:
            if marker in self.source and self._is_one_token(marker):
                token = self.tokenizer.convert_tokens_to_ids(marker)
                if token not in ids:
                    ids.append(token)
        return ids

    def saved_template(self) -> str:
        """The template to save with a model trained through this formatter: its source, with the thinking switch
        fixed as trained, so that Hugging Face or vLLM inference renders the prompts the model learned."""
        if "enable_thinking" in self.template_kwargs:
            return ("{%- set enable_thinking = " + str(self.template_kwargs["enable_thinking"]).lower() + " %}"
                    + self.source)
        return self.source

    def render(self, system: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
               location: str = "record", tools: list[dict[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        conversation = ([{"role": "system", "content": system}] if system else []) + list(messages)
        extra = {"tools": tools} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(conversation, chat_template=self.source, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **extra, **self.template_kwargs)
        except TemplateError as err:
            hint = " (its family's named template may accept it, e.g. template: gemma folds the system prompt " \
                   "into the first turn)" if self.name == "tokenizer" else ""
            raise RLHFInputError(f"{location}: chat template '{self.name}' refuses this record: {err}{hint}") from None

    def _render(self, record: dict[str, Any], messages: list[dict[str, Any]], add_generation_prompt: bool,
                system: str | None = None) -> str:
        return self.render(record["system"] if system is None else system, messages, add_generation_prompt,
                           record.get("location", "record"), record.get("tools"))

    def _check_tools(self, record: dict[str, Any], turns: list[dict[str, Any]]) -> None:
        """A record with tools, tool calls or tool results needs a template that writes them: one that does not
        would drop them without a word."""
        needs = {"tools": bool(record.get("tools")), "tool calls": any(m.get("tool_calls") for m in turns),
                 "tool results": any(m["role"] == "tool" for m in turns)}
        if not any(needs.values()):
            return
        if self.name == "tokenizer":
            writes = {"tools": "tools" in self.source, "tool calls": "tool_calls" in self.source,
                      "tool results": "tool" in self.source}
        else:
            writes = {what: what in TEMPLATES[self.name].tools for what in needs}
        missing = [what for what, needed in needs.items() if needed and not writes[what]]
        if missing:
            able = ", ".join(name for name, record in TEMPLATES.items() if record.tools)
            raise RLHFInputError(f"{record.get('location', 'record')}: chat template '{self.name}' cannot write "
                                 f"{' or '.join(missing)}; use the model's own template (template: auto) if it has "
                                 f"them, or {able}")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def with_images(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record with its image placeholders turned into the model's image tokens (once; a text record as
        it is). Images for a text-only model are an error, not text."""
        if not record.get("images") or record.get("images_expanded"):
            return record
        if self.vision is None:
            raise RLHFInputError(f"{record.get('location', 'record')}: the record has images, but the model is a "
                                 f"text-only model (or the stage trains on text: images train vision-language "
                                 "policies in sft, dpo, kto and grpo); use a vision-language model (tiny-vl, Qwen2-VL, "
                                 f"Qwen2.5-VL, Qwen3-VL, LLaVA) or remove the images column")
        return {**self.vision.expand_record(record), "images_expanded": True}

    def prompt_text(self, record: dict[str, Any]) -> str:
        record = self.with_images(record)
        self._check_tools(record, record["messages"])
        return self._render(record, record["messages"], True)

    def prompt_ids(self, record: dict[str, Any]) -> list[int]:
        """Tokens of the prompt with the assistant header appended, ready for generation."""
        return self.encode(self.prompt_text(record))

    def layout(self, record: dict[str, Any],
               final: str | dict[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text (with ``final`` as the last assistant turn) and the character span of every
        assistant turn in it: from the end of the prompt that precedes the turn to the end of what the template
        writes for it (its end-of-turn marker included). The text is the template's rendering of the whole
        conversation; a template whose finished conversation does not start with its own prompt (Mistral-Nemo
        drops the system prompt there) gets the prompt followed by the turn, which is what generation sees."""
        record = self.with_images(record)
        messages, where = record["messages"], record.get("location", "record")
        answer = final if isinstance(final, dict) or final is None else {"role": "assistant", "content": final}
        turns = [*messages, *([answer] if answer else [])]
        self._check_tools(record, turns)
        prompt = self._render(record, messages, True)
        spans = [self._history_span(record, prompt, i) for i, m in enumerate(messages) if m["role"] == "assistant"]
        if answer is None:
            return prompt, spans
        whole = self._render(record, turns, False)
        if not whole.startswith(prompt):
            whole = prompt + self._answer_text(record, answer)
        if len(whole) == len(prompt):
            raise RLHFInputError(f"{where}: chat template '{self.name}' writes nothing for the assistant's answer, so "
                                 f"there is nothing to train on; choose another template")
        return whole, [*spans, (len(prompt), len(whole))]

    def _answer_text(self, record: dict[str, Any], answer: dict[str, Any]) -> str:
        """What the template writes for the answer after a prompt, for templates whose finished conversation
        does not start with their prompt: taken where the template is consistent, the same conversation without
        its system prompt, else a one-question conversation."""
        where = record.get("location", "record")
        for messages in (record["messages"], record["messages"][-1:]):
            prompt = self._render(record, messages, True, system="")
            whole = self._render(record, [*messages, answer], False, system="")
            if whole.startswith(prompt):
                return whole[len(prompt):]
        raise RLHFInputError(f"{where}: chat template '{self.name}' renders a finished conversation that does not "
                             f"start with its own prompt, so the answer's tokens cannot be told apart; choose another "
                             f"template")

    def _history_span(self, record: dict[str, Any], prompt: str, index: int) -> tuple[int, int]:
        """Span of an earlier assistant turn inside the prompt's text (multi-turn data). It starts where the
        prompt for that turn ends (or, where the template writes the history otherwise, after the message before
        it and what closes that message), and ends after its content (or, for a turn that only calls tools, at its
        end-of-turn marker) with the template's end-of-turn text."""
        messages = record["messages"]
        head = self._render(record, messages[:index], True)
        if prompt.startswith(head):
            start = len(head)
        else:  # the history is written otherwise (Mistral moves the system prompt and tools to the last question)
            _, previous_end = self._content_span(record, messages, index - 1, prompt, True)
            start = previous_end + _matched(prompt[previous_end:], self._after(record, messages[:index - 1],
                                                                                messages[index - 1], True))
        after = self._after(record, messages[:index], {"role": "assistant", "content": ""}, False)
        if messages[index]["content"]:
            _, content_end = self._content_span(record, messages, index, prompt, True)
            return start, content_end + _matched(prompt[content_end:], after)
        marker = after.split("\n")[0] or after  # a turn of tool calls only: its end-of-turn marker
        at = prompt.find(marker, start) if marker else -1
        if at < 0:
            raise RLHFInputError(f"{record.get('location', 'record')}: chat template '{self.name}' writes no end "
                                 f"marker after assistant turn {index + 1}, so where it ends cannot be told; "
                                 f"choose another template")
        return start, at + _matched(prompt[at:], after)

    def _after(self, record: dict[str, Any], before: list[dict[str, Any]], message: dict[str, Any],
               add_generation_prompt: bool) -> str:
        """What the template writes after ``message``'s content when it is the last message: its end-of-turn
        text (and, with ``add_generation_prompt``, the assistant header that follows)."""
        marked = self._render(record, [*before, {**message, "content": _TURN_SENTINEL}], add_generation_prompt)
        return marked[marked.index(_TURN_SENTINEL) + len(_TURN_SENTINEL):]

    def _content_span(self, record: dict[str, Any], turns: list[dict[str, str]], index: int, text: str,
                      add_generation_prompt: bool) -> tuple[int, int]:
        """Where turn ``index``'s content lies in ``text``: rendered again with a sentinel as that content, the text
        before and after the sentinel must be the text around it."""
        where = record.get("location", "record")
        marked_turns = [*turns[:index], {**turns[index], "content": _TURN_SENTINEL}, *turns[index + 1:]]
        marked = self._render(record, marked_turns, add_generation_prompt)
        at = marked.find(_TURN_SENTINEL)
        tail = len(marked) - at - len(_TURN_SENTINEL)
        if (at < 0 or marked.count(_TURN_SENTINEL) != 1 or text[:at] != marked[:at]
                or text[len(text) - tail:] != marked[at + len(_TURN_SENTINEL):]):
            raise RLHFInputError(f"{where}: chat template '{self.name}' does not write assistant turn {index + 1} "
                                 f"where its text can be found, so its tokens cannot be told from the prompt's; "
                                 f"choose another template")
        return at, len(text) - tail

    def conversation(self, record: dict[str, Any], train_on_prompt: bool = False,
                     mask_history: bool = False) -> tuple[list[int], list[int]]:
        """(input_ids, labels) for a whole conversation ending with ``record['response']``; every assistant turn
        is a target (only the last one with ``mask_history``)."""
        text, spans = self.layout(record, record.get("response_message") or record["response"])
        ids, bounds = encode_at_boundaries(self.tokenizer, text, [p for span in spans for p in span])
        if train_on_prompt:
            labels = list(ids)
        else:
            labels = [IGNORE_INDEX] * len(ids)
        trained = list(zip(bounds[0::2], bounds[1::2]))
        for number, (start, end) in enumerate(trained):
            if mask_history and number < len(trained) - 1:
                labels[start:end] = [IGNORE_INDEX] * (end - start)
            else:
                labels[start:end] = ids[start:end]
        return ids, labels

    def prompt_and_completion(self, record: dict[str, Any], completion: str) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) of the conversation that ends with ``completion``: one encoding cut where
        the completion's turn starts, so the two together are the whole conversation's tokens."""
        text, spans = self.layout(record, completion)
        ids, (cut,) = encode_at_boundaries(self.tokenizer, text, [spans[-1][0]])
        return ids[:cut], ids[cut:]

    def completion_ids(self, record: dict[str, Any], completion: str) -> list[int]:
        """Tokens of ``completion`` as the template renders it after the prompt (end marker included)."""
        return self.prompt_and_completion(record, completion)[1]

    def completion_text(self, record: dict[str, Any], completion: str) -> str:
        """What the template renders after the prompt for this assistant turn (end marker included)."""
        text, spans = self.layout(record, completion)
        return text[spans[-1][0]:]

    def preference_ids(self, record: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        """(prompt, chosen, rejected) ids: each side is its whole conversation's encoding; the prompt is the tokens
        both share before their turns start (a token merged across the seam goes to the completions)."""
        prompt, chosen = self.prompt_and_completion(record, record["chosen"])
        prompt_r, rejected = self.prompt_and_completion(record, record["rejected"])
        shared = len(os.path.commonprefix([prompt, prompt_r]))
        return prompt[:shared], prompt[shared:] + chosen, prompt_r[shared:] + rejected


@contextlib.contextmanager
def saved_as_trained(model: nn.Module | None, tokenizer: Any, formatter: ChatFormatter | None) -> Iterator[None]:
    """While a trained model is saved: the tokenizer carries the chat template training rendered with (a named
    template, a fixed thinking switch) and the model's ``generation_config`` lists every stop token, so that
    ``from_pretrained`` + ``apply_chat_template`` + ``generate`` (Hugging Face, vLLM) render the same prompts and
    stop at the end of the turn. The objects are put back afterwards: training goes on with them as they were."""
    if formatter is None:
        yield
        return
    template = tokenizer.chat_template
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    tokenizer.chat_template = formatter.saved_template()
    if generation is not None:
        stops = list(formatter.stop_token_ids)
        generation.eos_token_id = stops[0] if len(stops) == 1 else stops
    try:
        yield
    finally:
        tokenizer.chat_template = template
        if generation is not None:
            generation.eos_token_id = eos


def _matched(text: str, expected: str) -> int:
    """How much of ``expected`` starts ``text``: all of it, or up to the end of its last whole line, so that a
    partial match never ends inside a marker ('<' of '<|im_end|>' against '<think>')."""
    shared = len(os.path.commonprefix([text, expected]))
    return shared if shared == len(expected) else expected.rfind("\n", 0, shared) + 1


def truncate_example(ids: list[int], labels: list[int], cutoff_len: int) -> tuple[list[int], list[int], str]:
    """Cut to ``cutoff_len``; status is ok | truncated | dropped (no target token survives)."""
    if len(ids) <= cutoff_len:
        return ids, labels, "ok"
    ids, labels = ids[:cutoff_len], labels[:cutoff_len]
    if all(label == IGNORE_INDEX for label in labels):
        return [], [], "dropped"
    return ids, labels, "truncated"


def pack_sequences(examples: Iterable[tuple[list[int], list[int]]], cutoff_len: int) -> list[dict[str, list[int]]]:
    """Concatenate examples into rows of at most ``cutoff_len`` tokens, in order.

    ``position_ids`` restart at 0 for each example, which transformers turns into a block-diagonal
    attention mask (flash-attn varlen, sdpa and eager alike), and the first token of each example
    gets no label, so nothing is predicted across an example boundary.
    """
    rows: list[dict[str, list[int]]] = []
    current: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ids, labels in examples:
        if current["input_ids"] and len(current["input_ids"]) + len(ids) > cutoff_len:
            rows.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += ids
        current["labels"] += [IGNORE_INDEX] + labels[1:]
        current["position_ids"] += list(range(len(ids)))
    if current["input_ids"]:
        rows.append(current)
    return rows


def _fingerprint(*parts: Any) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    return _fingerprint(tokenizer.name_or_path, len(tokenizer), sorted(tokenizer.get_vocab().items())[:2000:7])


@contextlib.contextmanager
def _environment_kept(*names: str) -> Iterator[None]:
    """Put the environment variables ``names`` back as they were when a library call inside changed them."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# what an SFT example's tokens come from
SFT_RECORD_KEYS = ("system", "messages", "response", "response_message", "tools", "images")


class SFTDataset(torch.utils.data.Dataset):
    """Prompt/response records tokenised once (Hugging Face ``datasets``, cached on disk by content hash).

    Items are ``{"input_ids", "labels"}`` (plus ``position_ids`` when packed). ``stats`` counts what
    truncation cut and dropped, so nothing disappears silently.
    """

    def __init__(self, records: list[dict[str, Any]], tokenizer: Any, formatter: ChatFormatter, *,
                 cutoff_len: int, train_on_prompt: bool = False, mask_history: bool = False,
                 packing: bool = False, cache_dir: str | os.PathLike | None = None,
                 num_proc: int | None = None) -> None:
        from datasets import Dataset

        self.formatter, self.cutoff_len = formatter, cutoff_len
        self.train_on_prompt, self.mask_history = train_on_prompt, mask_history
        key = _fingerprint("sft-v2", [{k: r.get(k) for k in SFT_RECORD_KEYS} for r in records],
                           _tokenizer_fingerprint(tokenizer), formatter.source, cutoff_len, train_on_prompt,
                           mask_history, *([formatter.vision.fingerprint()] if formatter.vision else []))
        cache = Path(cache_dir or _default_cache_dir()) / "tokenized"
        cache.mkdir(parents=True, exist_ok=True)
        # one JSON string per record: Arrow would merge the records' nested tool calls into one schema, giving
        # every message every key (tool arguments each other's names, as nulls)
        raw = Dataset.from_list([{"record": json.dumps({k: r.get(k) for k in (*SFT_RECORD_KEYS, "location")})}
                                 for r in records])
        with _environment_kept("TOKENIZERS_PARALLELISM"):  # datasets turns it off for the whole process when forking
            tokenized = raw.map(self._encode_batch, batched=True, remove_columns=raw.column_names, num_proc=num_proc,
                                cache_file_name=str(cache / f"sft-{key}.arrow"), new_fingerprint=key,
                                desc="tokenising")
        status = tokenized["status"]
        self.stats = {"records": len(records), "truncated": status.count("truncated"),
                      "dropped": status.count("dropped")}
        if self.stats["truncated"] or self.stats["dropped"]:
            logger.warning("cutoff_len=%d: truncated %d and dropped %d of %d records (raise cutoff_len to keep them)",
                           cutoff_len, self.stats["truncated"], self.stats["dropped"], len(records))
        kept = [i for i, s in enumerate(status) if s != "dropped"]
        if not kept:
            raise RLHFInputError(f"config field 'cutoff_len' ({cutoff_len}) leaves no trainable record; raise it")
        self.data = tokenized.select(kept).select_columns(["input_ids", "labels",
                                                           *(["images"] if formatter.vision else [])])
        self.rows: list[dict[str, list[int]]] | None = None
        if packing:
            self.rows = pack_sequences(zip(self.data["input_ids"], self.data["labels"]), cutoff_len)
            logger.info("packed %d examples into %d sequences of <= %d tokens", len(self.data), len(self.rows),
                        cutoff_len)

    def _encode_batch(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "status": [], "images": []}
        for text in batch["record"]:
            record = {k: v for k, v in json.loads(text).items() if v is not None}
            ids, labels = self.formatter.conversation(record, self.train_on_prompt, self.mask_history)
            ids, labels, status = truncate_example(ids, labels, self.cutoff_len)
            item = {"input_ids": ids, "labels": labels}
            if record.get("images") and status != "dropped":
                status = _with_record_images(item, record, status, self.formatter.vision)
            out["input_ids"].append(item["input_ids"])
            out["labels"].append(item["labels"])
            out["status"].append(status)
            out["images"].append(item.get("images", []))
        return out

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.data)

    def lengths(self) -> list[int]:
        """Tokens per item, for length-grouped batching."""
        if self.rows is not None:
            return [len(row["input_ids"]) for row in self.rows]
        return [len(ids) for ids in self.data["input_ids"]]

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index] if self.rows is not None else self.data[int(index)]


def _with_record_images(item: dict[str, Any], record: dict[str, Any], status: str, vision: VisionInputs) -> str:
    """An encoded item of a record with images takes the images' paths (the collator encodes them); an item whose
    truncation cut into an image is dropped, since its image's features would no longer fit its tokens."""
    if vision.count_image_tokens(item.get("prompt_ids", item.get("input_ids"))) != vision.expected_tokens(record):
        return "dropped"
    item["images"] = record["images"]
    return status


class StreamingRecordDataset(torch.utils.data.IterableDataset):
    """Records streamed from disk with Hugging Face ``datasets`` (constant memory on multi-GB JSONL),
    parsed into canonical records of ``kind`` and encoded by ``_encode``.

    Each process reads its own share (``split_dataset_by_node``); ``state_dict`` records the stream
    position so a resumed run continues with the next unseen record.
    """

    kind = "sft"

    BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

    def __init__(self, spec: DatasetSpec, tokenizer: Any, formatter: ChatFormatter, *, cutoff_len: int,
                 train_on_prompt: bool = False, mask_history: bool = False, rank: int = 0, world_size: int = 1,
                 buffer_size: int = 0, seed: int = 0, skip_invalid: bool = False, max_samples: int | None = None,
                 skip: int = 0) -> None:
        """``max_samples`` caps the stream (counted before ``skip``); the first ``skip`` records are left
        out (they are the validation set when ``val_size`` is used with streaming)."""
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        if not spec.files:
            raise RLHFInputError(f"dataset '{spec.name}': streaming reads local files only")
        builders = {self.BUILDERS.get(p.suffix) for p in spec.files}
        if len(builders) != 1 or None in builders:
            raise RLHFInputError(f"dataset '{spec.name}': streaming needs files of one type (.jsonl, .json, .parquet "
                                 "or .csv)")
        self.spec, self.formatter, self.cutoff_len = spec, formatter, cutoff_len
        self.train_on_prompt, self.mask_history, self.skip_invalid = train_on_prompt, mask_history, skip_invalid
        stream = load_dataset(builders.pop(), data_files=[str(p) for p in spec.files], split="train", streaming=True)
        if max_samples:
            stream = stream.take(max_samples)
        if skip:
            stream = stream.skip(skip)
        self._skipped = skip
        if buffer_size:
            stream = stream.shuffle(seed=seed, buffer_size=buffer_size)
        self.stream = split_dataset_by_node(stream, rank=rank, world_size=world_size)
        # single-file streams are split example by example (record i goes to rank i % world_size)
        self._stride = (world_size, rank) if stream.num_shards % world_size and not buffer_size else (1, 0)
        self.stats = {"records": 0, "truncated": 0, "dropped": 0, "invalid": 0}
        self.epoch = 0

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        source = self.spec.files[0] if len(self.spec.files) == 1 else self.spec.name
        iterator = iter(self.stream)
        while True:
            try:
                raw = next(iterator)
            except StopIteration:
                return
            except Exception as err:  # the JSON reader names the problem but not our dataset
                raise RLHFInputError(f"{source}: could not read the stream ({str(err).splitlines()[0]})") from None
            self.stats["records"] += 1
            step, offset = self._stride
            location = f"{source} (record {self._skipped + (self.stats['records'] - 1) * step + offset + 1})"
            try:
                record = to_record(parse_record(raw, self.spec, location), self.kind, location)
            except RLHFInputError:
                if not self.skip_invalid:
                    raise
                self.stats["invalid"] += 1
                continue
            item, status = self._encode(record)
            if record.get("images") and status != "dropped":
                status = _with_record_images(item, record, status, self.formatter.vision)
            if status != "ok":
                self.stats[status] += 1
            if status != "dropped":
                yield item

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        ids, labels = self.formatter.conversation(record, self.train_on_prompt, self.mask_history)
        ids, labels, status = truncate_example(ids, labels, self.cutoff_len)
        return {"input_ids": ids, "labels": labels}, status

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.stream.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "epoch": self.epoch, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_epoch(state["epoch"])
        self.stream.load_state_dict(state["stream"])
        self.stats = dict(state["stats"])


class StreamingSFTDataset(StreamingRecordDataset):
    """SFT records streamed from disk: items ``{"input_ids", "labels"}``."""

    kind = "sft"


@dataclass
class SFTCollator:
    """Pads a list of examples into a batch. Packed rows carry ``position_ids`` and no attention mask
    (transformers derives the per-example mask from the restarting positions)."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    vision: VisionInputs | None = None  # a vision-language model's: the batch also gets the rows' pixel inputs

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = "position_ids" in features[0]
        batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": [],
                                             ("position_ids" if packed else "attention_mask"): []}
        for f in features:
            pad = length - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * pad)
            if packed:  # padding forms its own "example" so real tokens never attend to it
                batch["position_ids"].append(list(f["position_ids"]) + list(range(pad)))
            else:
                batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
        out = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
        if self.vision is not None:
            out.update(self.vision.batch([f.get("images") or [] for f in features], out["input_ids"]))
        return out


def split_budget(prompt_len: int, response_len: int, cutoff_len: int) -> tuple[int, int]:
    """Tokens to keep of a prompt and its (longest) response so both fit ``cutoff_len``: a short
    response is kept whole, a short prompt is kept whole, otherwise the budget is shared in
    proportion to their lengths (LLaMA-Factory's ``infer_seqlen``)."""
    if prompt_len + response_len <= cutoff_len:
        return prompt_len, response_len
    if response_len * 2 < cutoff_len:
        response_keep = response_len
    elif prompt_len * 2 < cutoff_len:
        response_keep = cutoff_len - prompt_len
    else:
        response_keep = int(cutoff_len * response_len / (prompt_len + response_len))
    response_keep = min(response_keep, response_len)
    return min(cutoff_len - response_keep, prompt_len), response_keep


def truncate_prompt_and_responses(prompt_ids: list[int], responses: list[list[int]], cutoff_len: int
                                  ) -> tuple[list[int], list[list[int]], str]:
    """Fit prompt + each response into ``cutoff_len``: the prompt keeps its end (next to the
    response), each response its start, so the prompt/response boundary stays where it was.
    Status: ok | truncated | dropped (nothing of the prompt or of a response would survive)."""
    longest = max(len(r) for r in responses)
    prompt_keep, response_keep = split_budget(len(prompt_ids), longest, cutoff_len)
    if prompt_keep == len(prompt_ids) and response_keep == longest:
        return prompt_ids, responses, "ok"
    if prompt_keep <= 0 or response_keep <= 0:
        return [], [[] for _ in responses], "dropped"
    return prompt_ids[len(prompt_ids) - prompt_keep:], [r[:response_keep] for r in responses], "truncated"


def _encode_preference(formatter: ChatFormatter, record: dict[str, Any], cutoff_len: int) -> tuple[dict[str, Any], str]:
    prompt, chosen, rejected = formatter.preference_ids(record)
    prompt, (chosen, rejected), status = truncate_prompt_and_responses(prompt, [chosen, rejected], cutoff_len)
    item = {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}
    if record.get("margin") is not None:
        item["margin"] = float(record["margin"])
    return item, status


def _encode_kto(formatter: ChatFormatter, record: dict[str, Any], cutoff_len: int) -> tuple[dict[str, Any], str]:
    prompt, completion = formatter.prompt_and_completion(record, record["response"])
    prompt, (completion,), status = truncate_prompt_and_responses(prompt, [completion], cutoff_len)
    return {"prompt_ids": prompt, "completion_ids": completion, "label": bool(record["label"])}, status


class _EncodedRecords(torch.utils.data.Dataset):
    """Records encoded once into token-id items, with truncation counted in ``stats``; reference
    log-probs can be attached per item (``precompute_ref_log_probs``)."""

    kind = ""

    def __init__(self, records: list[dict[str, Any]], tokenizer: Any, formatter: ChatFormatter, *,
                 cutoff_len: int) -> None:
        self.formatter, self.cutoff_len = formatter, cutoff_len
        items, statuses = [], []
        for record in records:
            item, status = self._encode(record)
            if record.get("images") and status != "dropped":
                status = _with_record_images(item, record, status, formatter.vision)
            statuses.append(status)
            if status != "dropped":
                items.append(item)
        self.items = items
        self.stats = {"records": len(records), "truncated": statuses.count("truncated"),
                      "dropped": statuses.count("dropped")}
        if self.stats["truncated"] or self.stats["dropped"]:
            logger.warning("cutoff_len=%d: truncated %d and dropped %d of %d %s records (raise cutoff_len to keep "
                           "them)",
                           cutoff_len, self.stats["truncated"], self.stats["dropped"], len(records), self.kind)
        if records and not items:
            raise RLHFInputError(f"config field 'cutoff_len' ({cutoff_len}) leaves no trainable record; raise it")

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[int(index)]

    def lengths(self) -> list[int]:
        return [len(item["prompt_ids"]) + max(len(v) for k, v in item.items()
                                              if k.endswith("_ids") and k != "prompt_ids")
                for item in self.items]

    def attach(self, key: str, values: list[float]) -> None:
        """Store one float per item (e.g. reference log-probs computed before training)."""
        for item, value in zip(self.items, values, strict=True):
            item[key] = float(value)


class PreferenceDataset(_EncodedRecords):
    """Prompt + chosen/rejected pairs: items ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (and
    ``margin`` when the record has one). Truncation keeps the prompt's end and the responses' start."""

    kind = "preference"

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return _encode_preference(self.formatter, record, self.cutoff_len)


class KTODataset(_EncodedRecords):
    """Single responses labelled desirable/undesirable, each paired with a mismatched completion.

    KTO's reference point z0 is estimated from (prompt, completion) pairs that do not belong
    together (Ethayarajh et al. 2024, sec. 4.1). Item i's KL pair is its prompt with the completion
    of the item after it in a seeded shuffle, fixed here so that batches, resume and precomputed
    reference log-probs all see the same pairs. Items: ``{"prompt_ids", "completion_ids", "label",
    "kl_completion_ids"}``.
    """

    kind = "kto"

    def __init__(self, records: list[dict[str, Any]], tokenizer: Any, formatter: ChatFormatter, *, cutoff_len: int,
                 seed: int = 0) -> None:
        super().__init__(records, tokenizer, formatter, cutoff_len=cutoff_len)
        order = list(range(len(self.items)))
        random.Random(seed).shuffle(order)
        for position, index in enumerate(order):
            partner = self.items[order[(position + 1) % len(order)]]
            budget = max(1, cutoff_len - len(self.items[index]["prompt_ids"]))
            self.items[index]["kl_completion_ids"] = partner["completion_ids"][:budget]
        desirable = sum(item["label"] for item in self.items)
        self.stats.update(desirable=desirable, undesirable=len(self.items) - desirable)
        if len(self.items) and (desirable == 0 or desirable == len(self.items)):
            logger.warning("KTO data has only %s examples; KTO learns from both kinds",
                           "desirable" if desirable else "undesirable")

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return _encode_kto(self.formatter, record, self.cutoff_len)


class StreamingPreferenceDataset(StreamingRecordDataset):
    """Preference pairs streamed from disk (items as in :class:`PreferenceDataset`)."""

    kind = "preference"

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return _encode_preference(self.formatter, record, self.cutoff_len)


class StreamingKTODataset(StreamingRecordDataset):
    """KTO examples streamed from disk. A stream cannot be shuffled ahead, so each item's KL pair is
    the previous streamed item's completion (the first item pairs with its own, once)."""

    kind = "kto"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        previous = None
        for item in super().__iter__():
            partner = previous if previous is not None else item
            budget = max(1, self.cutoff_len - len(item["prompt_ids"]))
            item = {**item, "kl_completion_ids": partner["completion_ids"][:budget]}
            previous = item
            yield item

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return _encode_kto(self.formatter, record, self.cutoff_len)


def _encode_prompt(formatter: ChatFormatter, record: dict[str, Any], cutoff_len: int) -> tuple[dict[str, Any], str]:
    """A prompt for online RL: its tokens (the end kept if too long, next to where generation starts)
    and the answer that travels with it to the reward functions."""
    prompt = formatter.prompt_ids(record)
    status = "ok"
    if len(prompt) > cutoff_len:
        prompt, status = prompt[len(prompt) - cutoff_len:], "truncated"
    return {"prompt_ids": prompt, "answer": record.get("answer"), "verifiable": bool(record.get("verifiable")),
            "messages": record["messages"], "system": record["system"]}, status


class GRPODataset(_EncodedRecords):
    """Prompts for online RL (every sampled stage, GRPO to PPO): prompt-only records, lists of prompt strings, or
    ``{"prompt", "answer", "verifiable"}``. Items: ``{"prompt_ids", "answer", "verifiable",
    "messages", "system"}``; prompts longer than ``cutoff_len`` keep their end and are counted."""

    kind = "prompt"

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return _encode_prompt(self.formatter, record, self.cutoff_len)

    def lengths(self) -> list[int]:
        return [len(item["prompt_ids"]) for item in self.items]


class DistillDataset(GRPODataset):
    """Prompts for distillation with the dataset's response to each (SFT records: their ``response``, or a last
    turn that is the assistant's). Items: GRPODataset's plus ``response``, the text of that turn."""

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        messages, response = record["messages"], record.get("response")
        if response is None and messages and messages[-1].get("role") == "assistant":
            messages, response = messages[:-1], messages[-1]["content"]
        if not isinstance(response, str):
            raise RLHFInputError(f"{record.get('location', 'record')}: a distill record needs the assistant's response "
                                 f"(the off-policy steps train on it)")
        item, status = _encode_prompt(self.formatter, {**record, "messages": messages}, self.cutoff_len)
        return {**item, "response": response}, status


class StreamingGRPODataset(StreamingRecordDataset):
    """Online-RL prompts streamed from disk (items as in :class:`GRPODataset`); resumable."""

    kind = "prompt"

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return _encode_prompt(self.formatter, record, self.cutoff_len)


def _pad_rows(rows: list[list[int]], labels: list[list[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    length = max(len(r) for r in rows)
    return {"input_ids": torch.tensor([r + [pad_token_id] * (length - len(r)) for r in rows], dtype=torch.long),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows], dtype=torch.long),
            "labels": torch.tensor([lab + [IGNORE_INDEX] * (length - len(lab)) for lab in labels], dtype=torch.long)}


def _prompt_completion(prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
    return prompt + completion, [IGNORE_INDEX] * len(prompt) + completion


def _first_fit_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` placed first-fit by decreasing length into rows holding ``capacity`` each
    (a longer item gets a row of its own)."""
    rows: list[list[int]] = []
    fills: list[int] = []
    for item in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        row = next((r for r, fill in enumerate(fills) if fill + lengths[item] <= capacity), None)
        if row is None:
            rows.append([])
            fills.append(0)
            row = len(rows) - 1
        rows[row].append(item)
        fills[row] += lengths[item]
    return rows


def _layout_work(slots: int, width: int, hidden_size: int) -> float:
    """pack_rows' estimate of the compute of ``slots`` token slots in rows ``width`` wide (see pack_rows)."""
    return slots * (1 + width / (6 * hidden_size))


def pack_rows(lengths: list[int], hidden_size: int | None = None, candidates: int = 16) -> list[list[int]]:
    """Rows for packing items of these lengths, chosen to cost the least compute.

    Every row is padded to the widest, so the work is rows x width slots. The linear layers cost the
    same per slot (about 24 h^2 FLOPs per token and layer for hidden size h); attention grows with the
    row's width L (QK^T and AV: about 4 h L, the whole row, since the tree mask is not causal-sparse), so a
    slot costs ~ 1 + L / (6 h). Capacities from the longest item to twice it are tried first-fit and the
    cheapest layout wins, usually a little wider than the longest item with fewer rows. Without
    ``hidden_size`` the rows hold at most the longest item."""
    longest = max(lengths)
    if hidden_size is None:
        return _first_fit_rows(lengths, longest)

    def work(rows: list[list[int]]) -> float:
        width = max(sum(lengths[i] for i in row) for row in rows)
        return _layout_work(len(rows) * width, width, hidden_size)

    layouts = [_first_fit_rows(lengths, longest + longest * k // candidates) for k in range(candidates + 1)]
    return min(layouts, key=work)  # ties keep the narrowest capacity


def pack_preference_pairs(items: list[dict[str, Any]], pad_token_id: int,
                          hidden_size: int | None = None) -> dict[str, torch.Tensor]:
    """Pairs packed into a few rows without padding between them, each pair as prompt | chosen | rejected.

    The prompt is stored once; rejected attends to it and to itself, never to chosen (the tree mask
    is built from ``packed_pair`` / ``packed_branch`` by ``tree_attention_mask``), and its positions
    continue from the prompt's end, so every token sees exactly what it would in its own padded row.
    Rows are laid out by ``pack_rows`` (the model's ``hidden_size`` weighs attention against the
    linear layers). ``packed_source`` points every
    completion token at the position whose logits predict it: the previous token, or for a
    completion's first token the prompt's last. Completion ids and masks come as in share_prompt.
    Every prompt must be non-empty (its last token predicts the completion's first)."""
    lengths = [len(i["prompt_ids"]) + len(i["chosen_ids"]) + len(i["rejected_ids"]) for i in items]
    rows = pack_rows(lengths, hidden_size)
    fills = [sum(lengths[pair] for pair in row) for row in rows]
    width = max(fills)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    pair_of = torch.full((len(rows), width), -1, dtype=torch.long)
    branch = torch.zeros((len(rows), width), dtype=torch.long)
    completions = [i["chosen_ids"] for i in items] + [i["rejected_ids"] for i in items]
    padded = _pad_rows(completions, completions, pad_token_id)
    source = torch.zeros_like(padded["input_ids"])  # (2B, C); padding slots point at 0 and are masked
    for r, members in enumerate(rows):
        start = 0
        for pair in members:
            prompt, chosen, rejected = (items[pair][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
            p, c, n = len(prompt), len(chosen), len(rejected)
            end = start + p + c + n
            ids[r, start:end] = torch.tensor(prompt + chosen + rejected)
            positions[r, start:end] = torch.cat([torch.arange(p + c), torch.arange(p, p + n)])
            pair_of[r, start:end] = pair
            branch[r, start + p:start + p + c], branch[r, start + p + c:end] = 1, 2
            prompt_last = r * width + start + p - 1
            source[pair, :c] = prompt_last + torch.arange(c)  # chosen token j <- position p - 1 + j
            rejected_from = r * width + start + p + c - 1 + torch.arange(n)
            rejected_from[:1] = prompt_last  # rejected's first token <- the prompt's last, like chosen's
            source[len(items) + pair, :n] = rejected_from
            start = end
    return {"packed_input_ids": ids, "packed_position_ids": positions, "packed_pair": pair_of, "packed_branch": branch,
            "packed_source": source, "completion_input_ids": padded["input_ids"],
            "completion_attention_mask": padded["attention_mask"]}


class PreferenceBatch(TypedDict, total=False):
    """What PreferenceCollator emits and the RM / DPO-family trainers read. A plain dict at run time, so
    accelerate moves it to the device and checkpoints nothing extra; the keys and shapes are typed here.
    Rows 0..B-1 are the chosen responses, rows B..2B-1 the rejected ones of the same pairs."""

    input_ids: torch.Tensor  # (2B, T) prompt + response, right-padded
    attention_mask: torch.Tensor  # (2B, T)
    labels: torch.Tensor  # (2B, T) response tokens, IGNORE_INDEX on the prompt and padding
    prompt_input_ids: torch.Tensor  # (B, P) left-padded prompts (share_prompt only)
    prompt_attention_mask: torch.Tensor  # (B, P)
    completion_input_ids: torch.Tensor  # (2B, C) responses alone, right-padded (share_prompt only)
    completion_attention_mask: torch.Tensor  # (2B, C)
    packed_input_ids: torch.Tensor  # (R, L) pairs packed into R rows: prompt, chosen, rejected (pack_pairs only)
    packed_position_ids: torch.Tensor  # (R, L) rejected positions continue from the prompt, as in its own row
    packed_pair: torch.Tensor  # (R, L) which pair of the batch a token belongs to, -1 for padding
    packed_branch: torch.Tensor  # (R, L) 0 prompt, 1 chosen, 2 rejected
    packed_source: torch.Tensor  # (2B, C) flat index (row * L + column) of the logits predicting each completion token
    margin: torch.Tensor  # (B) optional reward-model margin per pair
    ref_chosen_logps: torch.Tensor  # (B) precomputed reference log-probs
    ref_rejected_logps: torch.Tensor  # (B)


@dataclass
class PreferenceCollator:
    """Pairs -> one right-padded batch of 2B sequences, chosen rows first, so chosen and rejected go
    through the model in a single forward (see PreferenceBatch for the keys and shapes)."""

    pad_token_id: int
    share_prompt: bool = False  # also emit the prompt (left-padded) and completions apart, for shared_prefix_log_probs
    pack_pairs: bool = False  # with share_prompt: the packed tree layout instead of the prompt/completion rows
    # the model's, for pack_rows' cost estimate (None: rows hold at most the longest pair)
    hidden_size: int | None = None
    vision: VisionInputs | None = None  # a vision-language model's: pixel inputs for both rows of each pair

    def __call__(self, items: list[dict[str, Any]]) -> PreferenceBatch:
        pairs = [_prompt_completion(i["prompt_ids"], i["chosen_ids"]) for i in items]
        pairs += [_prompt_completion(i["prompt_ids"], i["rejected_ids"]) for i in items]
        batch = _pad_rows([p[0] for p in pairs], [p[1] for p in pairs], self.pad_token_id)
        if self.share_prompt and self.pack_pairs and all(i["prompt_ids"] for i in items):
            batch.update(pack_preference_pairs(items, self.pad_token_id, self.hidden_size))
        elif self.share_prompt:
            prompts = [i["prompt_ids"] for i in items]
            width = max(len(p) for p in prompts)
            batch["prompt_input_ids"] = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts])
            batch["prompt_attention_mask"] = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            completions = [i["chosen_ids"] for i in items] + [i["rejected_ids"] for i in items]
            padded = _pad_rows(completions, completions, self.pad_token_id)
            batch["completion_input_ids"] = padded["input_ids"]
            batch["completion_attention_mask"] = padded["attention_mask"]
        for key in ("margin", "ref_chosen_logps", "ref_rejected_logps"):
            if key in items[0]:
                batch[key] = torch.tensor([i[key] for i in items], dtype=torch.float32)
        if self.vision is not None:  # chosen rows, then rejected rows: the same images, encoded once
            batch.update(self.vision.batch([i.get("images") or [] for i in items], batch["input_ids"], repeats=2))
        return batch


class KTOBatch(TypedDict, total=False):
    """What KTOCollator emits: B (prompt, completion) rows, then their B mismatched KL rows (the
    completion of another example in the batch after this example's prompt)."""

    input_ids: torch.Tensor  # (2B, T)
    attention_mask: torch.Tensor  # (2B, T)
    labels: torch.Tensor  # (2B, T) completion tokens, IGNORE_INDEX elsewhere
    desirable: torch.Tensor  # (B) bool
    ref_logps: torch.Tensor  # (B) precomputed reference log-probs of the completions
    ref_kl_logps: torch.Tensor  # (B) ... and of the KL rows


@dataclass
class KTOCollator:
    """Examples -> B (prompt, completion) rows followed by their B mismatched KL rows (see KTOBatch)."""

    pad_token_id: int
    vision: VisionInputs | None = None  # a vision-language model's: pixel inputs for the rows and their KL rows

    def __call__(self, items: list[dict[str, Any]]) -> KTOBatch:
        rows = [_prompt_completion(i["prompt_ids"], i["completion_ids"]) for i in items]
        rows += [_prompt_completion(i["prompt_ids"], i["kl_completion_ids"]) for i in items]
        batch = _pad_rows([r[0] for r in rows], [r[1] for r in rows], self.pad_token_id)
        batch["desirable"] = torch.tensor([i["label"] for i in items], dtype=torch.bool)
        for key in ("ref_logps", "ref_kl_logps"):
            if key in items[0]:
                batch[key] = torch.tensor([i[key] for i in items], dtype=torch.float32)
        if self.vision is not None:  # a KL row is its example's prompt (and images) with another completion
            batch.update(self.vision.batch([i.get("images") or [] for i in items], batch["input_ids"], repeats=2))
        return batch


EQUATION_PATTERN = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*(-?\d+)")


def split_steps(response: str, delimiter: str = "\n") -> list[str]:
    """Reasoning steps: the response cut after each ``delimiter``; blank pieces join the step before
    them, so concatenating the steps gives the response back exactly."""
    steps: list[str] = []
    parts = response.split(delimiter)
    for i, part in enumerate(parts):
        piece = part + (delimiter if i < len(parts) - 1 else "")
        if steps and not part.strip():
            steps[-1] += piece
        elif piece:
            steps.append(piece)
    return steps


def arithmetic_step_labels(steps: list[str], *, complete: bool = False) -> list[bool | None]:
    """The demo's step verifier (Math-Shepherd-style automatic labels): a step ``a op b = c`` is
    correct when the arithmetic holds; an ``Answer: N`` step when N is the last computed value;
    other steps are unlabelled (None).

    ``complete=True`` says the steps are a whole response, so its last step must give the answer: a
    response that stops without an ``Answer:`` line has its last step labelled wrong. Math-Shepherd
    labels a step by whether the solution can still reach the right answer from it, and nothing
    follows a final step. Without this, a PRM trained on these labels is told that every step of an
    answerless response is right, and ``min`` over its fewer steps ranks it above the complete one."""
    labels: list[bool | None] = []
    last = None
    for step in steps:
        equation, answer = EQUATION_PATTERN.search(step), ANSWER_PATTERN.search(step)
        if equation:
            a, op, b, c = int(equation[1]), equation[2], int(equation[3]), int(equation[4])
            labels.append({"+": a + b, "-": a - b, "*": a * b}[op] == c)
            last = c
        elif answer:
            labels.append(last is None or answer[1] == str(last))
        else:
            labels.append(None)
    if complete and steps and not ANSWER_PATTERN.search(steps[-1]):
        labels[-1] = False
    return labels


def arithmetic_response_labels(steps: list[str]) -> list[bool | None]:
    """``arithmetic_step_labels`` for a whole response (a training pair's chosen or rejected side)."""
    return arithmetic_step_labels(steps, complete=True)


STEP_LABELERS: dict[str, Callable[[list[str]], list[bool | None]] | None] = {"none": None,
                                                                               "arithmetic": arithmetic_response_labels}


def encode_steps(formatter: ChatFormatter, record: dict[str, Any], response: str, delimiter: str
                 ) -> tuple[list[int], list[int]]:
    """Completion tokens as the template renders them (cut from the whole conversation's encoding), and the index
    of each step's last token. Each step is found in the rendered turn in order (stripped, so templates that trim
    the content still line up); step k runs to the start of step k + 1, so the text between steps (the delimiter)
    joins the step before it, and the last step ends with its own text, before the end-of-turn marker.
    Returns (completion ids, index of each step's last token)."""
    text, spans = formatter.layout(record, response)
    turn_start = spans[-1][0]
    turn = text[turn_start:]
    starts, cursor = [], 0
    for step in split_steps(response, delimiter):
        found = turn.find(step.strip(), cursor)
        if found < 0:
            raise RLHFInputError(f"{record.get('location', 'record')}: chat template '{formatter.name}' does not "
                                 f"render the response's steps verbatim; cannot place step {step.strip()[:40]!r}")
        starts.append(found)
        cursor = found + len(step.strip())
    step_ends = [*starts[1:], cursor] if starts else [len(turn)]
    ids, bounds = encode_at_boundaries(formatter.tokenizer, text, [turn_start] + [turn_start + e for e in step_ends])
    cut = bounds[0]
    return ids[cut:], [max(bound - cut - 1, 0) for bound in bounds[1:]]


def _encode_process_pair(formatter: ChatFormatter, record: dict[str, Any], cutoff_len: int, delimiter: str,
                         labeler: Callable[[list[str]], list[bool | None]] | None) -> tuple[dict[str, Any], str]:
    prompt = formatter.prompt_ids(record)
    item: dict[str, Any] = {}
    encoded = {}
    for side in ("chosen", "rejected"):
        ids, ends = encode_steps(formatter, record, record[side], delimiter)
        steps = split_steps(record[side], delimiter)
        labels = record.get(f"{side}_step_labels") or (labeler(steps) if labeler else [None] * len(steps))
        if len(labels) != len(ends):
            raise RLHFInputError(f"{record.get('location', 'record')}: {len(labels)} step labels for {len(ends)} "
                                 f"'{side}' steps (steps are split at {delimiter!r})")
        encoded[side] = (ids, ends, labels)
    prompt, (chosen, rejected), status = truncate_prompt_and_responses(
        prompt, [encoded["chosen"][0], encoded["rejected"][0]], cutoff_len)
    for side, kept in (("chosen", chosen), ("rejected", rejected)):
        _, ends, labels = encoded[side]
        pairs = [(end, label) for end, label in zip(ends, labels) if end < len(kept)]  # steps cut off are dropped
        if not pairs:
            return {}, "dropped"
        item[f"{side}_ids"] = kept
        item[f"{side}_steps"] = [end for end, _ in pairs]
        item[f"{side}_labels"] = [-1.0 if label is None else float(label) for _, label in pairs]
    item["prompt_ids"] = prompt
    return item, status


class ProcessPreferenceDataset(_EncodedRecords):
    """Preference pairs for a process reward model: items as in :class:`PreferenceDataset` plus,
    per side, the position of each step's last token (``chosen_steps``) and its label
    (``chosen_labels``: 1 correct, 0 wrong, -1 unknown) from the record or from ``labeler``."""

    kind = "preference"

    def __init__(self, records: list[dict[str, Any]], tokenizer: Any, formatter: ChatFormatter, *, cutoff_len: int,
                 delimiter: str = "\n", labeler: str = "none") -> None:
        if labeler not in STEP_LABELERS:
            raise RLHFInputError(f"config field 'prm_step_labeler' is '{labeler}'; valid: {', '.join(STEP_LABELERS)}")
        self.delimiter, self.labeler = delimiter, STEP_LABELERS[labeler]
        super().__init__(records, tokenizer, formatter, cutoff_len=cutoff_len)

    def _encode(self, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return _encode_process_pair(self.formatter, record, self.cutoff_len, self.delimiter, self.labeler)


@dataclass
class ProcessPreferenceCollator:
    """Pairs -> 2B right-padded rows (chosen first) plus step positions into those rows.
    Shapes: input_ids, attention_mask, labels (2B, T); step_positions, step_mask, step_labels (2B, S)."""

    pad_token_id: int

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = PreferenceCollator(self.pad_token_id)(items)
        rows = [(i, side) for side in ("chosen", "rejected") for i in items]
        width = max(len(item[f"{side}_steps"]) for item, side in rows)
        positions = [[len(item["prompt_ids"]) + end for end in item[f"{side}_steps"]] for item, side in rows]
        labels = [item[f"{side}_labels"] for item, side in rows]
        batch["step_positions"] = torch.tensor([p + [0] * (width - len(p)) for p in positions], dtype=torch.long)
        batch["step_mask"] = torch.tensor([[True] * len(p) + [False] * (width - len(p)) for p in positions])
        batch["step_labels"] = torch.tensor([lab + [-1.0] * (width - len(lab)) for lab in labels], dtype=torch.float32)
        return batch


# ---- Batch order: seeded, resumable by position ----


def group_by_length(indices: list[int], lengths: Sequence[int], batch_size: int, megabatch: int = 50) -> list[int]:
    """Reorder a shuffled index list so each batch holds similar lengths: split it into chunks of
    ``megabatch`` batches and sort each chunk longest first (Hugging Face's LengthGroupedSampler).
    The order stays random at the chunk scale, and is a pure function of the input."""
    size = batch_size * megabatch
    chunks = [sorted(indices[i:i + size], key=lambda j: -lengths[j]) for i in range(0, len(indices), size)]
    return [index for chunk in chunks for index in chunk]


class ResumableBatchSampler:
    """Index batches for an in-memory dataset, endless across epochs, addressable by position.

    Epoch e uses the permutation seeded by ``seed + e``; each process takes every world_size-th index
    (wrapping so all processes see the same number). Batch k of the stream is a pure function of k,
    so resuming needs only the count of micro-batches already consumed.
    """

    def __init__(self, size: int, batch_size: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, lengths: Sequence[int] | None = None) -> None:
        self.size, self.batch_size, self.seed, self.start = size, batch_size, seed, start
        self.rank, self.world_size, self.shuffle, self.lengths = rank, world_size, shuffle, lengths
        self.per_process = math.ceil(size / world_size)
        self.batches_per_epoch = math.ceil(self.per_process / batch_size)

    def epoch_indices(self, epoch: int) -> list[int]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            order = list(range(self.size))
        order += order[: self.per_process * self.world_size - self.size]
        mine = order[self.rank::self.world_size]
        if self.lengths is not None:
            mine = group_by_length(mine, self.lengths, self.batch_size)
        return mine

    def __iter__(self) -> Iterator[list[int]]:
        position, cached_epoch, indices = self.start, -1, []
        while True:
            epoch, index = divmod(position, self.batches_per_epoch)
            if epoch != cached_epoch:
                cached_epoch, indices = epoch, self.epoch_indices(epoch)
            yield indices[index * self.batch_size:(index + 1) * self.batch_size]
            position += 1


# ==== 4. Model loading and the output head ====


LOG_SOFTMAX_CHUNK_ELEMENTS = 1 << 24  # 64 MB of fp32 scratch per chunk


def _log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension, half-precision logits normalised in fp32 (fp64 kept)."""
    return F.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per position, a chunk of rows at a time.

    A full (B, T, V) log-softmax would double peak memory on large vocabularies, so rows go through in
    chunks of at most LOG_SOFTMAX_CHUNK_ELEMENTS logits (one row at a time once a row alone is that
    large); a small model's whole batch is one chunk, one kernel instead of B. Half-precision logits
    are normalised in fp32. Shapes: logits (B, T, V), targets (B, T) -> (B, T).
    """
    rows_per_chunk = max(1, LOG_SOFTMAX_CHUNK_ELEMENTS // max(logits[0].numel(), 1)) if len(logits) else 1
    chunks = []  # log_softmax subtracts the row max first, so it stays exact at any logit scale
    for start in range(0, len(logits), rows_per_chunk):
        chunk = _log_softmax_fp32(logits[start:start + rows_per_chunk])
        chunks.append(chunk.gather(-1, targets[start:start + rows_per_chunk].unsqueeze(-1)).squeeze(-1))
    return torch.cat(chunks) if chunks else logits.new_zeros(targets.shape, dtype=torch.float32)


CHUNKED_HEAD_MIN_VOCAB = 32_000  # real vocabularies (Llama 2's 32k and up); a small one's logits cost nothing


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution. Shapes: (B, T, V) -> (B, T)."""
    logits = logits.float()
    return torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)


def _is_compiled(model: nn.Module) -> bool:
    """Whether torch.compile wrapped ``model`` or a wrapper inside it (DDP, PEFT)."""
    seen, inner = set(), model
    while inner is not None and id(inner) not in seen:
        if hasattr(inner, "_orig_mod"):
            return True
        seen.add(id(inner))
        inner = getattr(inner, "module", None) or (inner.get_base_model() if hasattr(inner, "get_base_model") else None)
    return False


class _CausalLMWrapper(nn.Module):
    """PolicyModel's base: a module that holds a causal LM as ``.model``, which OutputHead.of reads (this section
    comes before PolicyModel's, section 6)."""


class OutputHead:
    """How a causal LM's output becomes the log-probs, entropies and mean logits the losses use.

    With a small vocabulary (or a model this cannot verify) the model's own logits are used (``chunked`` is
    False, ``scores`` are logits). With a real one (32k-262k tokens) the (B, T, V) logits are never made whole:
    during the forward the output layer is swapped for one that keeps its input, so ``scores`` are the final
    hidden states (B, T, H), and each reduction runs the output layer over a chunk of positions at a time under
    activation checkpointing, so forward and backward hold one chunk's logits at most (the idea of Liger's and
    Apple's fused linear-cross-entropy, in plain torch). The same code paths lay out ``scores`` either way: their
    gathers and concatenations act on the leading dimensions only. Gemma's final logit soft-capping is applied here
    instead of in the model; a model whose head this cannot reproduce (checked on a short input once) keeps its
    own logits. Sharded (FSDP, ZeRO-3) and compiled models keep theirs too: their output layer's weights are only
    whole inside its own forward."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, model: nn.Module | None = None, attribute: str = "", vocab: int = 0,
                 softcap: float | None = None) -> None:
        # a weak reference: the cache's key is this model, and a value holding its key would keep it alive forever
        self._model = weakref.ref(model) if model is not None else None
        self.attribute, self.vocab, self.softcap = attribute, vocab, softcap
        self.chunked = model is not None

    @property
    def model(self) -> nn.Module:
        return self._model()

    @classmethod
    def of(cls, model: nn.Module) -> OutputHead:
        """The head for ``model`` (any wrapper: DDP, PEFT, torch.compile), decided and verified once per model."""
        model = model.model if isinstance(model, _CausalLMWrapper) else model
        inner = innermost_model(model)
        if inner not in cls._cache:
            cls._cache[inner] = cls._decide(model, inner)
        return cls._cache[inner]

    @classmethod
    def _decide(cls, model: nn.Module, inner: nn.Module) -> OutputHead:
        output = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
        vocab = getattr(output, "out_features", 0) or 0
        attribute = next((name for name, child in inner.named_children() if child is output), "")
        if (vocab < CHUNKED_HEAD_MIN_VOCAB or not isinstance(output, nn.Linear) or not attribute
                or _is_compiled(model) or any(hasattr(p, "ds_id") or type(p).__name__ == "DTensor"
                                              for p in output.parameters())):
            return cls()
        head = cls(inner, attribute, vocab, getattr(inner.config, "final_logit_softcapping", None))
        if not head._reproduces(model):
            logger.info("output layer of %s: its logits differ from a plain linear layer's; keeping the model's "
                        "own (B, T, V) logits", type(inner).__name__)
            return cls()
        return head

    @torch.no_grad()
    def _reproduces(self, model: nn.Module) -> bool:
        """Whether the chunked head gives the model's own logits, on a short input in eval mode (the Hugging Face
        model inside the wrappers; an adapter's layers are in it)."""
        inner, was_training = self.model, model.training
        inner.eval()
        try:
            output = inner.get_output_embeddings()
            ids = torch.arange(5, device=output.weight.device)[None] + 1
            want = inner(input_ids=ids, use_cache=False).logits.float()
            got = self._logits(self.scores(inner, input_ids=ids, use_cache=False)[0], output.weight, output.bias, 1.0)
            return bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3 * max(1.0, float(want.abs().max()))))
        except Exception:  # a forward that reads its output layer itself (Mamba's reads lm_head.weight's dtype)
            return False
        finally:
            inner.train(was_training)

    # -- the forward
    def scores(self, model: nn.Module, **inputs: Any) -> tuple[torch.Tensor, Any]:
        """Run ``model(**inputs)``; return (scores, the model's output). Scores: logits, or with a chunked head the
        final hidden states (the output's ``logits`` are then a NaN placeholder that must not be read)."""
        inputs.setdefault("use_cache", False)  # a scoring forward keeps no KV cache (unless given one to extend)
        if not self.chunked:
            out = model(**inputs)
            return out.logits, out
        keep = _HiddenStates(self.vocab)
        original = getattr(self.model, self.attribute)
        setattr(self.model, self.attribute, keep)
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        if softcap is not None:
            self.model.config.final_logit_softcapping = None  # applied in _logits, to each chunk
        try:
            out = model(**inputs)
        finally:
            setattr(self.model, self.attribute, original)
            if softcap is not None:
                self.model.config.final_logit_softcapping = softcap
        return keep.hidden, out

    # -- reductions over the vocabulary
    def log_probs(self, scores: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log softmax(logits / temperature)[target] per position. Shapes: scores (..., V|H), targets (...) -> (...)."""
        if not self.chunked:
            logits = scores if temperature == 1.0 else scores.float() / temperature
            return token_log_probs(logits, targets)
        return self._per_position(scores, targets, temperature, "log_probs")

    def sampled_log_probs(self, scores: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                          top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
        """log-prob of each target under the distribution a sampler with these settings draws from: the
        temperature-scaled softmax narrowed by min_p, top_k and top_p and renormalised (vLLM's
        'processed_logprobs'); -inf for a target outside the kept tokens. Shapes: as ``log_probs``."""

        if not (top_k or top_p < 1 or min_p > 0):
            return self.log_probs(scores, targets, temperature)
        if not self.chunked:
            return token_log_probs(_filter_logits(scores.float() / temperature, top_k, top_p, min_p), targets)
        return self._per_position(scores, targets, temperature, ("sampled", top_k, top_p, min_p))

    def entropy(self, scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Entropy of each position's next-token distribution. Shapes: (..., V|H) -> (...)."""
        if not self.chunked:
            return token_entropy(scores if temperature == 1.0 else scores.float() / temperature)
        return self._per_position(scores, None, temperature, "entropy")

    def mean_logits(self, scores: torch.Tensor) -> torch.Tensor:
        """Each position's logits averaged over the vocabulary, detached (a logged statistic). Shapes: -> (...)."""
        if not self.chunked:
            return scores.detach().float().mean(-1)
        with torch.no_grad():
            return self._per_position(scores.detach(), None, 1.0, "mean")

    def _per_position(self, scores: torch.Tensor, targets: torch.Tensor | None, temperature: float,
                      what: str | tuple) -> torch.Tensor:
        output = self.model.get_output_embeddings()
        flat = scores.reshape(-1, scores.shape[-1])
        picked = targets.reshape(-1) if targets is not None else None
        rows = max(1, LOG_SOFTMAX_CHUNK_ELEMENTS // self.vocab)
        weight, bias = output.weight, output.bias
        if not flat.requires_grad:  # detached scores (a logged entropy): no gradient into the output layer either
            weight, bias = weight.detach(), bias.detach() if bias is not None else None
        reduce = _compiled_head_reduction() if getattr(self.model, "_rlhf_compiled_step", False) else head_reduction
        pieces = []
        for start in range(0, flat.shape[0], rows):
            args = (flat[start:start + rows], weight, bias, temperature, self.softcap, what,
                    picked[start:start + rows] if picked is not None else None)
            needs_grad = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
            pieces.append(torch.utils.checkpoint.checkpoint(reduce, *args, use_reentrant=False)
                          if needs_grad else reduce(*args))
        return torch.cat(pieces).reshape(scores.shape[:-1]) if pieces else flat.new_zeros(scores.shape[:-1])

    def _logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                temperature: float) -> torch.Tensor:
        return head_logits(hidden, weight, bias, temperature, self.softcap)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                softcap: float | None) -> torch.Tensor:
    """fp32 logits of one chunk of positions, Gemma's soft-capping and the temperature applied. (N, H) -> (N, V)."""
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits / temperature if temperature != 1.0 else logits


def head_reduction(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                   softcap: float | None, what: str | tuple, targets: torch.Tensor | None) -> torch.Tensor:
    """One chunk's reduction over the vocabulary (``OutputHead._per_position``): the target's log-prob, entropy,
    mean logit, or ("sampled", top_k, top_p, min_p) the target's log-prob under the narrowed distribution.
    (N, H) -> (N)."""
    logits = head_logits(hidden, weight, bias, temperature, softcap)
    if isinstance(what, tuple):  # ("sampled", top_k, top_p, min_p): the narrowed distribution
        logits, what = _filter_logits(logits, *what[1:]), "log_probs"
    if what == "mean":
        return logits.mean(-1)
    normaliser = torch.logsumexp(logits, -1)
    if what == "log_probs":
        return logits.gather(-1, targets[:, None]).squeeze(-1) - normaliser
    return normaliser - (logits.softmax(-1) * logits).sum(-1)


@functools.cache
def _compiled_head_reduction() -> Callable[..., torch.Tensor]:
    """``head_reduction`` under torch.compile (``torch_compile``): the chunk's logits, log-sum-exp and gather fused,
    so the fp32 (N, V) logits are written once instead of by each elementwise step."""
    return _eager_on_compile_error(torch.compile(head_reduction, dynamic=True))


class _HiddenStates(nn.Module):
    """Stands in for the output layer during a forward: keeps its input and returns a NaN view of the logits'
    shape that takes no memory (a read of it would poison the loss, not pass silently)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.hidden = vocab, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden.new_full((1,), float("nan")).expand(*hidden.shape[:-1], self.vocab)


@dataclass
class LogProbs:
    """Log-probabilities of completion tokens. Shapes: per_token (B, T-1) zero outside the completion,
    summed (B), lengths (B) = completion tokens per sequence."""

    per_token: torch.Tensor
    summed: torch.Tensor
    lengths: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        return self.summed / self.lengths.clamp(min=1)


def _remote_code_error(path: str | os.PathLike, err: BaseException) -> RLHFInputError | None:
    """transformers' refusal to run a model's own code, as the one-line config error it is (None for others)."""
    if not isinstance(err, ValueError) or "trust_remote_code" not in str(err):
        return None
    return RLHFInputError(f"config field 'model_name_or_path': {path} ships its own modelling code (auto_map in "
                          f"config.json), which runs as Python on load; set trust_remote_code=true if you trust it")


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer with a pad token (eos if it has none) and right padding for training."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as err:
        refusal = _remote_code_error(path, err)
        if refusal is None:
            raise
        raise refusal from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise RLHFInputError(f"tokenizer at {path} has neither a pad nor an eos token; add one to its config")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


TINY_MODEL_SETTINGS = {"vocab_size": 384, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


# The tiny tokenizer's training files. Pinned, so that adding a data file (rm_pairs.jsonl came later)
# does not change the embedded model's vocabulary; a corpus folder without them uses all its *.jsonl.
TINY_CORPUS_FILES = ("eval.jsonl", "kto.jsonl", "multistep.jsonl", "preference.jsonl", "rl_prompts.jsonl", "sft.jsonl")


def _tiny_corpus_files(corpus_dir: Path) -> list[Path]:
    pinned = [corpus_dir / name for name in TINY_CORPUS_FILES]
    return pinned if all(path.exists() for path in pinned) else sorted(corpus_dir.glob("*.jsonl"))


def _demo_corpus(corpus_dir: Path) -> Iterator[str]:
    for path in _tiny_corpus_files(corpus_dir):
        for _, record in _iter_jsonl_file(path):
            yield "system\nuser\nassistant\n"  # the chat template's role names, so each is one token
            for key in ("prompt", "response", "chosen", "rejected"):
                if isinstance(record.get(key), str):
                    yield record[key]


def build_tiny_model(cache_dir: str | os.PathLike | None = None, corpus_dir: str | os.PathLike | None = None,
                     seed: int = 0) -> Path:
    """The embedded default model: a small Llama with a byte-level BPE tokenizer trained on the demo
    corpus (digits split one per token, ChatML template), built once and cached in Hugging Face layout.

    Nothing is downloaded; the same corpus and seed give the same model on every machine.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus_dir = Path(corpus_dir) if corpus_dir is not None else _checkout_path("data/demo")
    files = _tiny_corpus_files(corpus_dir)
    if not files:
        raise RLHFInputError(f"model_name_or_path 'tiny' trains its tokenizer on {corpus_dir}, which has no .jsonl "
                             f"files; run from the project's checkout (it holds data/demo), or generate the data with "
                             f"`python scripts/make_demo_data.py`")
    key = _fingerprint("tiny-v2", TINY_MODEL_SETTINGS, seed,
                       [hashlib.sha256(p.read_bytes()).hexdigest() for p in files])
    target = Path(cache_dir or _default_cache_dir()) / f"tiny-llama-{key}"
    if (target / "config.json").exists():
        return target
    tokenizer_model = Tokenizer(models.BPE())
    tokenizer_model.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer_model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_MODEL_SETTINGS["vocab_size"], special_tokens=TINY_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer_model.train_from_iterator(_demo_corpus(corpus_dir), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer_model, eos_token="<|im_end|>",
                                        pad_token="<|pad|>", bos_token="<|endoftext|>", unk_token=None,
                                        chat_template=CHAT_TEMPLATES["chatml"])
    settings = {**TINY_MODEL_SETTINGS, "vocab_size": len(tokenizer)}
    config = LlamaConfig(**settings, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic publish; a concurrent builder may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built the embedded tiny model (%s parameters) at %s", f"{model.num_parameters():,}", target)
    return target


# The embedded models, which a config names instead of a path (``model_name_or_path: tiny``): name -> a builder of
# ``cache_dir`` returning the model's cached folder. Section 5 adds ``tiny-vl``.
EMBEDDED_MODELS: dict[str, Callable[..., Path]] = {"tiny": build_tiny_model}


def resolve_model_path(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """'tiny' / 'tiny-vl' -> the embedded models' cached directories; a ``.gguf`` file -> its dequantised Hugging Face
    folder (``gguf_to_hf``); anything else is passed to from_pretrained."""
    if isinstance(name_or_path, str) and name_or_path in EMBEDDED_MODELS:
        return str(EMBEDDED_MODELS[name_or_path](cache_dir))
    if str(name_or_path).startswith("~"):  # configs that name a model under the home folder (~/.cache/rlhf/models/...)
        name_or_path = str(Path(name_or_path).expanduser())
    if str(name_or_path).lower().endswith(".gguf"):
        return str(gguf_to_hf(name_or_path, cache_dir))
    if (Path(name_or_path) / FINAL_SAVE_MARKER).exists():
        raise RLHFInputError(f"{name_or_path} holds a half-replaced model (its final save was killed); run the "
                             f"training command again, which resumes from its last checkpoint and saves it whole")
    return name_or_path


# ---- GGUF in: a llama.cpp file becomes a Hugging Face folder, once per content ----
# transformers reads a GGUF's config, tokenizer and (dequantised) weights; doing that at every load costs seconds to
# minutes, and vLLM, PEFT and the reference model each want a folder. So a GGUF is converted once into
# <cache>/gguf/<name>-<sha256 prefix>/ (fp32 safetensors, tokenizer with the file's chat template, no quantization
# config) and every stage loads that folder like any other.

GGUF_CONVERSION_VERSION = 1  # raise when the conversion changes, so cached folders are rebuilt
# llama.cpp pre-tokenizers that transformers' GGUF reader leaves at GPT-2's split: what the model's own
# tokenizer.json does before the byte-level split (SmolLM: every digit on its own).
GGUF_PRE_TOKENIZER_FIXES = {"smollm": "digits"}


def _sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf_module(what: str) -> Any:
    if importlib.util.find_spec("gguf") is None:
        raise RLHFInputError(f"{what} needs the gguf package: pip install gguf (or pip install '.[gguf]')")
    import gguf

    return gguf


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF file's scalar and string metadata (arrays such as the vocabulary left out), read without its tensors."""
    gguf = _gguf_module(f"reading {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as err:
        raise RLHFInputError(f"{path} is not a readable GGUF file ({str(err).splitlines()[0][:120]})") from None
    metadata = {}
    for key, entry in reader.fields.items():
        if entry.types and entry.types[0] == gguf.GGUFValueType.ARRAY and len(entry.data) > 64:
            continue
        try:
            metadata[key] = entry.contents()
        except (ValueError, TypeError, IndexError):
            continue
    return metadata


def _gguf_sha256(path: Path, index_dir: Path) -> str:
    """The file's sha256, remembered by (path, size, mtime) so an unchanged multi-GB file is hashed once."""
    stat = path.stat()
    memo = index_dir / f"{_fingerprint(str(path.resolve()), stat.st_size, stat.st_mtime_ns)}.sha256"
    if memo.exists():
        return memo.read_text().strip()
    digest = _sha256_of_file(path)
    index_dir.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest


def _fix_gguf_pre_tokenizer(tokenizer: Any, pre: str | None) -> None:
    if GGUF_PRE_TOKENIZER_FIXES.get(pre or "") == "digits":
        from tokenizers import pre_tokenizers

        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         backend.pre_tokenizer])


def gguf_to_hf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, *,
               field: str = "model_name_or_path") -> Path:
    """Dequantise a GGUF file into a Hugging Face folder under ``cache_dir/gguf`` (once per file content: the folder is
    named by the file's sha256) and return the folder. The tokenizer, its chat template and special tokens come from
    the file. An architecture transformers cannot read is a one-line error naming it."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise RLHFInputError(f"config field '{field}': GGUF file '{gguf_path}' does not exist (working directory "
                             f"{os.getcwd()})")
    root = Path(cache_dir or _default_cache_dir()) / "gguf"
    digest = _gguf_sha256(path, root / "index")
    target = root / f"{path.stem}-{digest[:16]}"
    if (target / "config.json").exists() and (target / "gguf_source.json").exists():
        return target
    metadata = gguf_metadata(path)
    architecture = _readable_gguf_architecture(path, metadata, field)
    logger.info("converting %s (%s, %.0f MB) into a Hugging Face folder, once: %s", path.name, architecture,
                path.stat().st_size / 2**20, target)
    model, tokenizer = _dequantised_gguf_model(path, metadata, architecture, field)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _write_json_atomic(tmp / "gguf_source.json", {"file": str(path.resolve()), "sha256": digest,
                                                  "architecture": architecture,
                                                  "name": metadata.get("general.name"),
                                                  "file_type": metadata.get("general.file_type"),
                                                  "conversion": GGUF_CONVERSION_VERSION})
    root.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)  # atomic publish; a concurrent converter may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _readable_gguf_architecture(path: Path, metadata: dict[str, Any], field: str) -> str:
    """A GGUF file's architecture, when transformers can read it; else a one-line error naming it."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = str(metadata.get("general.architecture", "?"))
    spellings = {architecture, architecture.replace("-", "_"), architecture.replace("moe", "_moe")}
    if not spellings & set(GGUF_SUPPORTED_ARCHITECTURES):
        raise RLHFInputError(f"config field '{field}': {path.name} is a GGUF of architecture '{architecture}', which "
                             "this transformers cannot read (it reads "
                             f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); convert the original checkpoint "
                             "instead, or upgrade transformers")
    return architecture


def _dequantised_gguf_model(path: Path, metadata: dict[str, Any], architecture: str, field: str) -> tuple[Any, Any]:
    """(model, tokenizer) of a GGUF file, read by transformers: fp32 weights in a plain model of the same config, and
    the file's tokenizer with its pre-tokenizer fixed (GGUF_PRE_TOKENIZER_FIXES)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        except (ValueError, NotImplementedError, KeyError) as err:
            raise RLHFInputError(f"config field '{field}': transformers cannot read {path.name} (architecture "
                                 f"'{architecture}': {str(err).splitlines()[0][:160]})") from None
    _fix_gguf_pre_tokenizer(tokenizer, metadata.get("tokenizer.ggml.pre"))
    # a plain model of the same config: the loaded one carries its GGUF quantizer, which save_pretrained would record
    config_dict = {k: v for k, v in loaded.config.to_dict().items()
                   if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")}
    config = type(loaded.config).from_dict(config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own progress bars and info lines off for a library call (a GGUF's per-tensor bar, say)."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _torch_dtype(name: str | torch.dtype) -> torch.dtype | str:
    if isinstance(name, torch.dtype) or name == "auto":
        return name
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _names_a_local_path(name: str | os.PathLike) -> bool:
    """A hub id is 'name' or 'owner/name'; anything with a leading '/', '.' or '~', a backslash, more
    than one '/', or an 'owner' that is a folder here can only be a local path (so a missing one gets
    'does not exist' at once, not a minute of hub retries and a connection error)."""
    name = str(name)
    return (name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
            or ("/" in name and Path(name.split("/")[0]).is_dir()))


def quantization_config(config: BaseConfig) -> Any:
    """The bitsandbytes settings of a QLoRA stage (``quantization_bit``), or None. Without bitsandbytes it is an
    error, never an unquantised load: the run would use several times the memory it was sized for."""
    if config.quantization_bit is None:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RLHFInputError("config field 'quantization_bit' needs bitsandbytes: pip install bitsandbytes (its CPU "
                             "backend runs 4- and 8-bit layers here; a CUDA GPU runs them fast)")
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    if config.quantization_bit == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=config.quantization_type,
                              bnb_4bit_use_double_quant=config.double_quantization, bnb_4bit_compute_dtype=compute)


def is_quantized(model: nn.Module) -> bool:
    return bool(getattr(innermost_model(model), "is_quantized", False))


def _auto_model_class(path: str, trust_remote_code: bool = False) -> type:
    """``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a vision-language model that the causal-LM
    mapping does not take (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA: their configs nest a text and a vision config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return AutoModelForCausalLM  # its own from_pretrained gives the error, worded as for any model
    if type(config) in AutoModelForCausalLM._model_mapping or getattr(config, "vision_config", None) is None:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def load_causal_lm(path: str, *, dtype: str | torch.dtype = "float32", attn_implementation: str = "auto",
                   trust_remote_code: bool = False, device: torch.device | str = "cpu",
                   quantization: Any = None, field: str = "model_name_or_path") -> tuple[nn.Module, str]:
    """``AutoModelForCausalLM`` with the best attention backend this model and device support; ``quantization``
    (``quantization_config``) loads its linear layers quantised, on ``device``. ``field``: the config field that
    named ``path``, for error messages."""
    if _names_a_local_path(path) and not Path(path).expanduser().exists():
        raise RLHFInputError(f"config field '{field}': '{path}' does not exist; give a saved model "
                             f"directory (check the path and the working directory {os.getcwd()}) or 'tiny'")
    if Path(path).is_dir() and not (Path(path) / "config.json").exists():
        raise RLHFInputError(f"config field '{field}': directory '{path}' has no config.json, so it is not "
                             f"a Hugging Face model; point it at a saved model (or an adapter) or use 'tiny'")
    implementation, reason = select_attention_implementation(attn_implementation, device)
    kwargs = dict(dtype=_torch_dtype(dtype), trust_remote_code=trust_remote_code)
    auto_class = _auto_model_class(path, trust_remote_code)
    if quantization is not None:
        kwargs.update(quantization_config=quantization, device_map={"": torch.device(device)})
    try:
        try:
            model = auto_class.from_pretrained(path, attn_implementation=implementation, **kwargs)
        except (ValueError, ImportError) as err:
            refusal = _remote_code_error(path, err)
            if refusal is not None:
                raise refusal from None
            if implementation == "eager" or "attn" not in str(err).lower() and "attention" not in str(err).lower():
                raise
            reason = f"{implementation} unsupported by this model ({str(err).splitlines()[0][:80]})"
            implementation = "eager"
            model = auto_class.from_pretrained(path, attn_implementation=implementation, **kwargs)
    except OSError as err:
        raise RLHFInputError(f"config field '{field}': cannot load '{path}' ({str(err).splitlines()[0][:160]}); "
                             f"give a local Hugging Face model directory or 'tiny'") from None
    # an explicit request that cannot run here is worth a warning (Hugging Face would refuse it); auto is not
    if attn_implementation in ("auto", implementation):
        logger.info("attention: %s (%s)", implementation, reason)
    else:
        logger.warning("attention: %s was requested, but %s runs instead (%s)", attn_implementation, implementation,
                       reason)
    return model, implementation


# ==== 5. Vision-language models ====

# Images in, the model's image tokens and pixel inputs out.
# LLaMA-Factory's multimodal records put an "<image>" placeholder in the text for each entry of "images". Before the
# chat template renders a record, each placeholder becomes the tokens the model's processor would write for that
# image (Qwen2/2.5/3-VL: <|vision_start|> + one <|image_pad|> per merged patch + <|vision_end|>; LLaVA: one <image>
# per vision feature), so the ChatFormatter and every loss mask work on text as before; the collator then adds the
# pixel inputs the model's forward takes. The stock Qwen processors cannot be built without torchvision (their video
# processor needs it), so the expansion is done here from the image processor, as LLaMA-Factory's mm_plugin does.

VISION_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "image_repeats")  # a vision-language batch's
# module-name pieces of each part of a vision-language model (LLaMA-Factory's visual.py keys, matched as substrings)
VISION_TOWER_KEYS = ("visual.patch_embed", "visual.pos_embed", "visual.blocks", "visual.deepstack_merger_list",
                     "vision_tower")
PROJECTOR_KEYS = ("visual.merger", "multi_modal_projector")  # LANGUAGE_MODEL_KEYS: in section 0, shared


def text_config(model: nn.Module) -> Any:
    """The language model's config: the model's own, or a vision-language model's text config (whose top level has no
    hidden_size or vocab_size)."""
    config = innermost_model(model).config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_vision_language(model: nn.Module) -> bool:
    return getattr(getattr(innermost_model(model), "config", None), "vision_config", None) is not None


def vision_kwargs(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The pixel inputs of a batch (none for a text batch)."""
    return {key: batch[key] for key in VISION_KEYS if key in batch}


def fit_pixels(image: Any, max_pixels: int, min_pixels: int) -> Any:
    """Scale an image (aspect kept) so that its area lies within [min_pixels, max_pixels] (LLaMA-Factory's
    image_max_pixels / image_min_pixels, applied before the model's own processor)."""
    area = image.width * image.height
    if area > max_pixels or area < min_pixels:
        factor = math.sqrt((max_pixels if area > max_pixels else min_pixels) / area)
        image = image.resize((max(1, int(image.width * factor)), max(1, int(image.height * factor))))
    return image


class VisionInputs:
    """How one vision-language model takes images: the text each image placeholder becomes, and the pixel inputs of
    a batch. Families: ``qwen`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: patches of any image size, M-RoPE positions from
    ``image_grid_thw`` and ``mm_token_type_ids``) and ``llava`` (a fixed-size image, a fixed number of features).
    Encoded images are kept (by path) so that an image seen every epoch, or by chosen and rejected, is encoded once."""

    def __init__(self, config: Any, image_processor: Any, tokenizer: Any, *, max_pixels: int = 768 * 768,
                 min_pixels: int = 32 * 32, cache_size: int = 4096) -> None:
        self.image_processor, self.max_pixels, self.min_pixels = image_processor, max_pixels, min_pixels
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = config.image_token_index
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.family = "qwen" if getattr(config, "vision_start_token_id", None) is not None else "llava"
        # tokens that only a processor writes: generation never samples them (an image token in a completion would
        # ask the forward for image features it does not have)
        self.vision_token_ids = sorted({int(i) for i in (self.image_token_id, *(getattr(config, key, None) for key in
                                        ("video_token_id", "vision_start_token_id", "vision_end_token_id")))
                                        if i is not None})
        if self.family == "qwen":
            self.start = tokenizer.convert_ids_to_tokens(config.vision_start_token_id)
            self.end = tokenizer.convert_ids_to_tokens(config.vision_end_token_id)
            self.merge = int(image_processor.merge_size)
        else:  # LLaVA: the processor resizes to the tower's size; CLS is kept only by the 'full' strategy
            vision, strategy = config.vision_config, getattr(config, "vision_feature_select_strategy", "default")
            self.llava_tokens = (vision.image_size // vision.patch_size) ** 2 + (1 if strategy == "full" else 0)
            self.llava_processor = dict(patch_size=vision.patch_size, vision_feature_select_strategy=strategy,
                                        num_additional_image_tokens=1)  # CLS, as llava-hf's processors count it
        self._cache: collections.OrderedDict[str, tuple[torch.Tensor, torch.Tensor | None]] = collections.OrderedDict()
        self._cache_size = cache_size

    def save_pretrained(self, directory: str | os.PathLike, tokenizer: Any) -> None:
        """The image processor, and for LLaVA the whole processor (LlavaProcessor needs no torchvision), so that the
        output loads with AutoImageProcessor / AutoProcessor. The Qwen processors cannot be built without torchvision
        (their video processor): AutoProcessor assembles them from these files where it is installed."""
        self.image_processor.save_pretrained(directory)
        if self.family == "llava":
            from transformers import LlavaProcessor

            LlavaProcessor(image_processor=self.image_processor, tokenizer=tokenizer, image_token=self.image_token,
                           chat_template=tokenizer.chat_template, **self.llava_processor).save_pretrained(directory)

    def configure(self, config: BaseConfig) -> VisionInputs:
        self.max_pixels, self.min_pixels = config.image_max_pixels, config.image_min_pixels
        self._cache.clear()
        return self

    def fingerprint(self) -> str:
        processor = (self.image_processor.to_dict() if hasattr(self.image_processor, "to_dict")
                     else repr(self.image_processor))
        return _fingerprint(self.family, self.image_token, self.max_pixels, self.min_pixels,
                            json.dumps(processor, sort_keys=True, default=str))

    def encode(self, path: str, location: str = "record") -> tuple[torch.Tensor, torch.Tensor | None]:
        """(pixel_values, image_grid_thw or None) of one image file, as the model's processor gives them."""
        if path in self._cache:
            self._cache.move_to_end(path)
            return self._cache[path]
        image = fit_pixels(open_image(path, location), self.max_pixels, self.min_pixels)
        if self.family == "qwen" and max(image.width, image.height) > 200 * min(image.width, image.height):
            raise RLHFInputError(f"{location}: image '{path}' is {image.width}x{image.height}; Qwen-VL models take an "
                                 f"aspect ratio of at most 200, so crop or pad it")
        out = self.image_processor(images=[image], return_tensors="pt")
        encoded = (out["pixel_values"], out.get("image_grid_thw"))
        self._cache[path] = encoded
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return encoded

    def tokens_text(self, path: str, location: str = "record") -> str:
        """What one image placeholder becomes in the text."""
        if self.family == "llava":
            return self.image_token * self.llava_tokens + "\n"  # LLaVA's own template puts a newline after the image
        grid = self.encode(path, location)[1]
        return self.start + self.image_token * (int(grid.prod()) // self.merge ** 2) + self.end

    def expand_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record with each image placeholder replaced by its image's tokens, in order of appearance."""
        images = iter(record.get("images") or [])
        location = record.get("location", "record")

        def expand(text: str) -> str:  # split first: LLaVA's image token is the placeholder itself
            pieces = text.split(IMAGE_PLACEHOLDER)
            return pieces[0] + "".join(self.tokens_text(next(images), location) + piece for piece in pieces[1:])

        def images_first(text: str) -> str:  # LLaVA's processor template writes a turn's images before its text
            return IMAGE_PLACEHOLDER * text.count(IMAGE_PLACEHOLDER) + text.replace(IMAGE_PLACEHOLDER, "")

        expanded = dict(record)
        order = images_first if self.family == "llava" else (lambda text: text)
        expanded["messages"] = [{**m, "content": expand(order(m["content"]))} if isinstance(m.get("content"), str)
                                else m for m in record["messages"]]
        for key in ("response", "chosen", "rejected"):
            if isinstance(record.get(key), str):
                expanded[key] = expand(record[key])
        return expanded

    def count_image_tokens(self, ids: Sequence[int]) -> int:
        return sum(token == self.image_token_id for token in ids)

    def expected_tokens(self, record: dict[str, Any]) -> int:
        """Image tokens the record's images take in its prompt."""
        return sum(self.tokens_text(path, record.get("location", "record")).count(self.image_token)
                   for path in record.get("images") or [])

    def batch(self, images: Sequence[Sequence[str]], input_ids: torch.Tensor,
              repeats: int = 1) -> dict[str, torch.Tensor]:
        """The pixel inputs of a batch whose rows carry ``images`` (one list of paths per row, in row order).
        ``repeats``: the rows are that many copies of the rows that ``images`` lists (a preference batch's chosen and
        rejected rows): the pixels are given once, with ``image_repeats``, so that PolicyModel.forward can encode
        each image once for all its copies."""
        paths = [path for row in images for path in row]
        if not paths:
            return {}
        encoded = [self.encode(path) for path in paths]
        out = {"pixel_values": torch.cat([pixels for pixels, _ in encoded])}
        if repeats > 1:
            out["image_repeats"] = torch.tensor(repeats)
        if self.family == "qwen":  # positions (M-RoPE) need every row's grids
            out["image_grid_thw"] = torch.cat([grid for _, grid in encoded] * repeats)
            out["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        return out


def load_vision_inputs(model: nn.Module, tokenizer: Any, path: str,
                       trust_remote_code: bool = False) -> VisionInputs | None:
    """The VisionInputs of a vision-language model (None for a text model), with its image processor from ``path``:
    the PIL implementation, which needs no torchvision."""
    if not is_vision_language(model):
        return None
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(path, backend="pil", trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise RLHFInputError(f"{path} is a vision-language model without a readable image processor "
                             f"(preprocessor_config.json or processor_config.json): {_one_line(err)}") from None
    return VisionInputs(innermost_model(model).config, processor, tokenizer)


def _frozen_part_keys(config: BaseConfig) -> tuple[str, ...]:
    """The module-name keys of the parts a config's freeze switches hold still."""
    return ((VISION_TOWER_KEYS if config.freeze_vision_tower else ())
            + (PROJECTOR_KEYS if config.freeze_multi_modal_projector else ())
            + (LANGUAGE_MODEL_KEYS if config.freeze_language_model else ()))


def set_trainable_parts(model: nn.Module, config: BaseConfig) -> None:
    """``freeze_vision_tower``, ``freeze_multi_modal_projector`` and ``freeze_language_model`` (LLaMA-Factory's
    switches): the frozen parts' parameters take no gradient. Runs after the finetuning type, so that it also
    freezes what full or freeze training left trainable."""
    frozen = _frozen_part_keys(config)
    for name, parameter in model.named_parameters():
        if any(key in name for key in frozen):
            parameter.requires_grad_(False)


def lora_target_names(model: nn.Module, config: BaseConfig, short_names: list[str]) -> list[str]:
    """``lora_target: all`` on a vision-language model: every linear layer of the parts that train, named in full,
    so that the vision tower (and the projector) get no adapter unless their freeze switch is off; the patch
    embedding never does (LLaMA-Factory's rule)."""
    skipped = (*_frozen_part_keys(config), "patch_embed", "lm_head")
    return [name for name, module in model.named_modules()
            if _is_linear(module) and name.rsplit(".", 1)[-1] in short_names and not any(k in name for k in skipped)]


TINY_VL_VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "patch_size": 8,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                  "deepstack_visual_indexes": []}
TINY_VL_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]


def build_tiny_vl_model(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """The embedded vision-language model, ``tiny-vl``: a small Qwen3-VL (the tiny model's language settings, a
    2-block vision tower of 8-pixel patches merged 2x2, so a 64x64 image is 16 tokens), the tiny tokenizer with
    Qwen's vision tokens added, and Qwen's image processor (PIL). Built offline, cached like ``tiny``."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    text_dir = build_tiny_model(cache_dir)
    key = _fingerprint("tiny-vl-v1", text_dir.name, TINY_VL_VISION, seed)
    target = Path(cache_dir or _default_cache_dir()) / f"tiny-qwen3-vl-{key}"
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": TINY_VL_SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATES["qwen3_vl_nothink"]
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    hidden = TINY_MODEL_SETTINGS["hidden_size"]
    head_dim = hidden // TINY_MODEL_SETTINGS["num_attention_heads"]
    text = {**TINY_MODEL_SETTINGS, "vocab_size": len(tokenizer), "head_dim": head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
                                "mrope_interleaved": True},
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    config = AutoConfig.for_model("qwen3_vl", text_config=text,
                                  vision_config={**TINY_VL_VISION, "out_hidden_size": hidden},
                                  tie_word_embeddings=True, **ids)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    processor = Qwen2VLImageProcessorPil(patch_size=TINY_VL_VISION["patch_size"],
                                         merge_size=TINY_VL_VISION["spatial_merge_size"],
                                         temporal_patch_size=TINY_VL_VISION["temporal_patch_size"],
                                         min_pixels=16 * 16, max_pixels=64 * 64, image_mean=[0.5] * 3,
                                         image_std=[0.5] * 3)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built the embedded tiny-vl model (%s parameters) at %s", f"{model.num_parameters():,}", target)
    return target


EMBEDDED_MODELS["tiny-vl"] = build_tiny_vl_model


# ==== 6. Policy, reward and value models ====


class PolicyModel(_CausalLMWrapper):
    """A causal LM (any ``AutoModelForCausalLM`` architecture, optionally with a PEFT adapter) plus its
    tokenizer: what every stage trains, generates from and saves."""

    def __init__(self, model: nn.Module, tokenizer: Any, attn_implementation: str = "eager",
                 vision: VisionInputs | None = None) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.attn_implementation = attn_implementation
        self.vision = vision  # a vision-language model's image handling (None: a text model)
        self.rollout_engine: Any = None  # a vLLM engine holding these weights: generate() samples with it

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str | torch.dtype = "float32",
                        attn_implementation: str = "auto", trust_remote_code: bool = False,
                        device: torch.device | str = "cpu",
                        cache_dir: str | os.PathLike | None = None, is_trainable: bool = True,
                        quantization: Any = None, field: str = "model_name_or_path") -> PolicyModel:
        """Load a model directory (or 'tiny'); a directory holding a PEFT adapter loads its base, then the adapter.
        ``quantization``: load the base quantised (QLoRA, ``quantization_config``)."""
        path = resolve_model_path(name_or_path, cache_dir)
        adapter_config = Path(path) / "adapter_config.json"
        base_path = (json.loads(adapter_config.read_text())["base_model_name_or_path"] if adapter_config.exists()
                     else path)
        if adapter_config.exists() and _names_a_local_path(base_path) and not Path(base_path).expanduser().exists():
            raise RLHFInputError(f"config field '{field}': {path} is an adapter whose base model {base_path} "
                                 f"(base_model_name_or_path in adapter_config.json) does not exist; restore the base "
                                 f"there or edit adapter_config.json")
        model, implementation = load_causal_lm(base_path, dtype=dtype, attn_implementation=attn_implementation,
                                               trust_remote_code=trust_remote_code, device=device,
                                               quantization=quantization, field=field)
        if adapter_config.exists():
            from peft import PeftModel

            with _peft_deprecation_quiet():
                model = PeftModel.from_pretrained(model, path, is_trainable=is_trainable)
        tokenizer_path = (path if (Path(path) / "tokenizer_config.json").exists() or not Path(path).exists()
                          else base_path)
        if quantization is None:  # a quantised model was placed by its device_map and refuses .to()
            model = model.to(device)
        tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
        return cls(model, tokenizer, implementation,
                   load_vision_inputs(model, tokenizer, tokenizer_path, trust_remote_code))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def is_peft(self) -> bool:
        from peft import PeftModel

        return isinstance(self.model, PeftModel)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(parameter_numel(p) for p in self.model.parameters() if p.requires_grad or not trainable_only)

    def prepare_for_training(self, config: BaseConfig) -> PolicyModel:
        """Apply the finetuning type (LoRA / OFT / freeze / full) and gradient checkpointing."""
        self.model = _prepare_backbone(self.model, config)
        _log_trainable(self.num_parameters(trainable_only=True), self.num_parameters(), config.finetuning_type)
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **vision: torch.Tensor) -> Any:
        """``vision``: a vision-language batch's pixel inputs (``vision_kwargs``)."""
        if "image_repeats" in vision:
            vision = self._encoded_once(dict(vision))
        kwargs = {"attention_mask": attention_mask, "use_cache": False, **vision}
        if position_ids is not None:  # packed rows; models without positions (Mamba) never get them
            kwargs["position_ids"] = position_ids
        return self.model(input_ids=input_ids, **kwargs)

    def _encoded_once(self, vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Pixel inputs given once for rows repeated ``image_repeats`` times (chosen and rejected): with the vision
        tower and projector frozen, each image is encoded once, without a graph, and its features serve every copy
        (``mm_encoder_outputs``); when they train, every copy is encoded, so each row's gradient reaches them."""
        repeats = int(vision.pop("image_repeats"))
        inner = innermost_model(self.model)
        if any(p.requires_grad for n, p in inner.named_parameters() if not any(k in n for k in LANGUAGE_MODEL_KEYS)):
            vision["pixel_values"] = torch.cat([vision["pixel_values"]] * repeats)
            return vision
        pixels, grid = vision.pop("pixel_values"), vision.get("image_grid_thw")
        once = {} if grid is None else {"image_grid_thw": grid[:len(grid) // repeats]}
        with torch.no_grad():
            encoded = inner.get_image_features(pixel_values=pixels, **once, return_dict=True)
        encoded.pooler_output = tuple(encoded.pooler_output) * repeats
        if getattr(encoded, "deepstack_features", None) is not None:  # Qwen3-VL: per layer, per image
            encoded.deepstack_features = [tuple(layer) * repeats for layer in encoded.deepstack_features]
        return {**vision, "mm_encoder_outputs": {"image": encoded}}

    def compute_log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                          temperature: float = 1.0, **vision: torch.Tensor) -> LogProbs:
        """Log-probs of the completion tokens: those whose ``labels`` are not IGNORE_INDEX (all real
        tokens after the first when ``labels`` is None); ``vision``: the rows' pixel inputs (``vision_kwargs``).
        Shapes: input_ids, attention_mask, labels (B, T) -> LogProbs(per_token (B, T-1), summed (B), lengths (B))."""
        head = OutputHead.of(self.model)
        scores, _ = head.scores(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                **vision)
        if labels is None:
            labels = (input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX) if attention_mask is not None
                      else input_ids)
        mask = labels[:, 1:] != IGNORE_INDEX  # (B, T-1): target t+1 is predicted at position t
        per_token = head.log_probs(scores[:, :-1], input_ids[:, 1:], temperature) * mask
        return LogProbs(per_token=per_token, summed=per_token.sum(-1), lengths=mask.sum(-1))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int = 64, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop_token_ids: list[int] | None = None, batch_size: int = 32, synced: bool = False,
                 images: Sequence[Sequence[str]] | None = None) -> list[list[int]]:
        """Complete token-id prompts with the generation engine (inference_optimizations.generate);
        returns each completion's ids, ending with its stop token if it produced one. ``synced``: the
        weights are sharded across processes, which then call this with as many prompts and decode in
        lockstep (see ``inference_optimizations.generate``). ``images``: each prompt's image paths (a
        vision-language model; its prompts hold the images' tokens)."""

        stop = tuple(stop_token_ids or [self.tokenizer.eos_token_id])
        params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                top_p=top_p, top_k=top_k, stop_token_ids=stop,
                                suppress_token_ids=self.suppressed_tokens)
        with_images = images is not None and any(images)
        if with_images and self.vision is None:
            raise RLHFInputError("prompts with images need a vision-language model; this one is text-only")
        if self.rollout_engine is not None and not with_images:  # vLLM holding this policy's weights (use_vllm)
            return self.rollout_engine.sample(prompts, params).token_ids
        was_training = self.model.training
        self.model.eval()
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
        results: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            vision = self.vision_for([images[i] for i in chunk]) if with_images else None
            output = generate_tokens(self.model, [prompts[i] for i in chunk], params,
                                     pad_token_id=self.tokenizer.pad_token_id, synced=synced, vision=vision)
            for i, tokens in zip(chunk, output.token_ids):
                results[i] = tokens
        self.model.train(was_training)
        return results

    @property
    def suppressed_tokens(self) -> tuple[int, ...]:
        """Tokens generation never samples: a vision-language model's image tokens, which only a processor writes."""
        return tuple(self.vision.vision_token_ids) if self.vision is not None else ()

    def vision_for(self, images: Sequence[Sequence[str]]) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        """The generation engine's ``vision`` for prompts that carry ``images`` (one list of paths per prompt): their
        pixel inputs, given the left-padded prompt ids."""
        return lambda ids: self.vision.batch(images, ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save_pretrained(self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Hugging Face layout (safetensors): loads with AutoModelForCausalLM, or PEFT for adapters.
        ``state_dict``: the weights to write instead of the module's own (a sharded model's, gathered whole)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        model = self.model._orig_mod if hasattr(self.model, "_orig_mod") else self.model  # unwrap torch.compile
        model.save_pretrained(directory, **({"state_dict": state_dict} if state_dict is not None else {}))
        self.tokenizer.save_pretrained(directory)
        if self.vision is not None:  # so that the output loads with AutoImageProcessor / AutoProcessor
            self.vision.save_pretrained(directory, self.tokenizer)


def chat_formatter(tokenizer: Any, config: BaseConfig, model: nn.Module | PolicyModel | None = None,
                   template: str | None = None) -> ChatFormatter:
    """The stage's ChatFormatter: its template and thinking switch, the model's generation stop tokens, and (for a
    vision-language PolicyModel) how its images become tokens."""
    vision = model.vision.configure(config) if isinstance(model, PolicyModel) and model.vision is not None else None
    model = model.model if isinstance(model, PolicyModel) else model
    return ChatFormatter(tokenizer, template or config.template, enable_thinking=config.enable_thinking,
                         generation_config=getattr(model, "generation_config", None), vision=vision)


def state_under(state: dict[str, torch.Tensor] | None, prefix: str) -> dict[str, torch.Tensor] | None:
    """The entries of a module's state dict that belong to its submodule ``prefix`` ("backbone."), named
    relative to it; None stays None (the module saves its own weights)."""
    if state is None:
        return None
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load_weights_into(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load safetensors weights saved by ``save_pretrained`` into an existing model, in place
    (the optimizer keeps pointing at the same parameters, which exact resume needs)."""

    directory = Path(directory)
    if (directory / "adapter_model.safetensors").exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(directory / "adapter_model.safetensors")))
        return
    index = directory / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(directory / name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    # tied weights (lm_head = embeddings) are saved once; they are "missing" but already loaded
    truly_missing = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
    if truly_missing or unexpected:
        raise RLHFInputError(f"checkpoint {directory} does not match the model (missing {truly_missing[:3]}, "
                             f"unexpected {unexpected[:3]})")


def decoder_of(model: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (``model.model`` for Llama, ``transformer`` for GPT-2,
    ``backbone`` for Mamba), through a PEFT wrapper, so hidden states come without the LM head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token, for right or left padding. Shapes: (B, T) -> (B)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask * positions).argmax(-1)


def scalar_head(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A reward or value head applied in its own precision (float32), outside autocast: under bf16 mixed
    precision its output would keep 8 bits of mantissa, so rewards a few hundredths apart tie or swap, which
    costs pairwise accuracy without showing in the loss. Shapes: (..., H) -> (...)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return head(hidden.to(next(head.parameters()).dtype)).squeeze(-1)


class RewardScorer(nn.Module):
    """A causal LM's transformer body plus a 2-layer head reading the last non-padding token."""

    def __init__(self, backbone: nn.Module, head_hidden: int | None = None, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = text_config(backbone).hidden_size
        self.head_hidden = head_hidden or hidden
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.head = nn.Sequential(nn.Linear(hidden, self.head_hidden), nn.GELU(), nn.Linear(self.head_hidden, 1))
            # small output init (Ziegler et al. 2019): initial rewards near 0, so early gradients are informative
            nn.init.normal_(self.head[2].weight, std=1 / math.sqrt(self.head_hidden + 1))
            nn.init.zeros_(self.head[2].bias)
        self.head.to(next(backbone.parameters()).device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                step_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Shapes: (B, T) -> scores (B); with step_positions (B, S), the score at each of them (B, S).
        Step scores are read here, in forward, so that a DDP-wrapped scorer synchronises their gradients."""
        hidden = decoder_of(self.backbone)(input_ids=input_ids, attention_mask=attention_mask,
                                           use_cache=False).last_hidden_state
        if step_positions is not None:
            at_steps = hidden.gather(1, step_positions[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, S, H)
            return scalar_head(self.head, at_steps)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_token_index(attention_mask)]
        return scalar_head(self.head, last)


def _adapter_type(model: nn.Module) -> str:
    if not hasattr(model, "peft_config"):
        return "full"
    return str(next(iter(model.peft_config.values())).peft_type.value).lower()


class RewardModel(nn.Module):
    """Scalar reward for a (prompt, response) sequence: ``RewardScorer`` plus its tokenizer.

    Saved in Hugging Face layout: the backbone as a causal LM (``full``) or a PEFT adapter over its
    base (``lora`` / ``oft``), the head in ``reward_head.safetensors`` and ``reward_config.json``.
    Loading a plain causal LM (e.g. the SFT model) starts a fresh, seeded head.
    """

    HEAD_FILE, CONFIG_FILE = "reward_head.safetensors", "reward_config.json"

    def __init__(self, model: RewardScorer, tokenizer: Any) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str | torch.dtype = "float32",
                        attn_implementation: str = "auto", trust_remote_code: bool = False,
                        device: torch.device | str = "cpu",
                        cache_dir: str | os.PathLike | None = None, head_hidden: int | None = None, seed: int = 0,
                        is_trainable: bool = True, quantization: Any = None) -> RewardModel:
        backbone = PolicyModel.from_pretrained(name_or_path, dtype=dtype, attn_implementation=attn_implementation,
                                               trust_remote_code=trust_remote_code, device=device,
                                               cache_dir=cache_dir, is_trainable=is_trainable,
                                               quantization=quantization)
        path = Path(resolve_model_path(name_or_path, cache_dir))
        saved = json.loads((path / cls.CONFIG_FILE).read_text()) if (path / cls.CONFIG_FILE).exists() else {}
        scorer = RewardScorer(backbone.model, head_hidden=saved.get("head_hidden", head_hidden), seed=seed)
        if saved:
            scorer.head.load_state_dict(load_file(str(path / cls.HEAD_FILE)))
        scorer.to(device)
        return cls(scorer, backbone.tokenizer)

    @property
    def is_peft(self) -> bool:
        return hasattr(self.model.backbone, "peft_config")

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(parameter_numel(p) for p in self.model.parameters() if p.requires_grad or not trainable_only)

    def prepare_for_training(self, config: BaseConfig) -> RewardModel:
        self.model.backbone = _prepare_backbone(self.model.backbone, config)
        self.model.head.requires_grad_(True)
        _log_trainable(self.num_parameters(True), self.num_parameters(), config.finetuning_type)
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention_mask)

    def save_pretrained(self, directory: str | os.PathLike, chat_template: str | None = None,
                        state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """``chat_template``: the template the model was trained with, recorded so that scorers outside
        rlhf (inference_optimizations.RewardModelScorer) render inputs the same way. ``state_dict``: the
        scorer's weights to write instead of its own (a sharded model's, gathered whole)."""

        directory = Path(directory)
        PolicyModel(self.model.backbone, self.tokenizer).save_pretrained(directory,
                                                                         state_under(state_dict, "backbone."))
        head = state_under(state_dict, "head.") or self.model.head.state_dict()
        save_file({k: v.detach().contiguous() for k, v in head.items()}, str(directory / self.HEAD_FILE))
        config = {"reward_model_type": _adapter_type(self.model.backbone), "head_hidden": self.model.head_hidden,
                  "hidden_size": text_config(self.model.backbone).hidden_size, "score": "last non-padding token"}
        if chat_template:
            config["chat_template"] = chat_template
        (directory / self.CONFIG_FILE).write_text(json.dumps(config, indent=1))

    def load_weights(self, directory: str | os.PathLike) -> None:
        load_weights_into(self.model.backbone, directory)
        self.model.head.load_state_dict(load_file(str(Path(directory) / self.HEAD_FILE)))


class RewardEnsemble(nn.Module):
    """K reward models scoring the same sequences: mean reward and the members' standard deviation
    (population, correction=0) as an uncertainty estimate. Saved as ``ensemble.json`` listing the
    member directories (each a RewardModel) relative to the ensemble directory."""

    MANIFEST = "ensemble.json"

    def __init__(self, members: list[RewardModel]) -> None:
        super().__init__()
        if not members:
            raise RLHFInputError("a reward-model ensemble needs at least one member")
        self.members = nn.ModuleList(members)
        self.tokenizer = members[0].tokenizer

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shapes: (B, T) -> mean (B), std (B)."""
        scores = torch.stack([member(input_ids, attention_mask) for member in self.members])  # (K, B)
        return scores.mean(0), scores.std(0, correction=0)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs: Any) -> RewardEnsemble:
        # a single reward model is an ensemble of one
        return cls([RewardModel.from_pretrained(str(member), **kwargs) for member in cls.member_dirs(directory)])

    @staticmethod
    def write_manifest(directory: str | os.PathLike, member_dirs: list[str]) -> None:
        (Path(directory) / RewardEnsemble.MANIFEST).write_text(json.dumps({"members": member_dirs}, indent=1))

    @staticmethod
    def member_dirs(directory: str | os.PathLike) -> list[Path]:
        """The reward-model directories a directory scores with: its manifest's members, or itself."""
        directory = Path(directory)
        manifest = directory / RewardEnsemble.MANIFEST
        if not manifest.exists():
            return [directory]
        try:
            names = json.loads(manifest.read_text())["members"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise RLHFInputError(f"{manifest}: not an ensemble manifest ({type(err).__name__}: {err}); it must be "
                                 'JSON like {"members": ["member-0", "member-1"]}') from None
        return [directory / name for name in names]

    @staticmethod
    def combine(directory: str | os.PathLike, sources: list[str | os.PathLike]) -> list[str]:
        """Write an ensemble at ``directory`` whose members are every member of ``sources`` (reward models
        or ensembles, e.g. two rm stages' outputs), listed by paths relative to it: nothing is copied.
        Reward models trained from different backbones err on different pairs, so their mean ranks more
        pairs right than either ensemble alone. Every member must share one tokenizer, because an
        ensemble scores one tokenisation of each sequence."""
        directory = Path(directory)
        members = [member for source in sources for member in RewardEnsemble.member_dirs(source)]
        if not members:
            raise RLHFInputError("combining reward models needs at least one source directory")
        for member in members:
            if not (member / "config.json").is_file():
                raise RLHFInputError(f"{member} holds no reward model (no config.json); give rm stage outputs")
        first = members[0]
        vocabulary = load_tokenizer(first).get_vocab()
        for member in members[1:]:
            if load_tokenizer(member).get_vocab() != vocabulary:
                raise RLHFInputError(f"{member} has another tokenizer than {first}; an ensemble scores one "
                                     "tokenisation, so combine reward models trained from one base model family")
        directory.mkdir(parents=True, exist_ok=True)
        names = [os.path.relpath(member.resolve(), directory.resolve()) for member in members]
        RewardEnsemble.write_manifest(directory, names)
        return names


def aggregate_step_scores(step_logits: torch.Tensor, step_mask: torch.Tensor, how: str = "min") -> torch.Tensor:
    """A response's process reward from its step logits, in log space: log p_k = logsigmoid(logit_k);
    ``min`` takes the weakest step, ``product`` sums the log-probs (all steps right, independently),
    ``last`` the final step (Lightman et al. 2023 sec. 2.6 compare min and product). A response
    without steps scores 0 (= log 1). Shapes: (B, S) logits and bool mask -> (B)."""
    if how not in PRM_AGGREGATIONS:
        raise RLHFInputError(f"unknown step aggregation '{how}'; valid: {', '.join(PRM_AGGREGATIONS)}")
    log_p = F.logsigmoid(step_logits.float())
    mask = step_mask.bool()
    if how == "min":
        return log_p.masked_fill(~mask, float("inf")).min(-1).values.masked_fill(~mask.any(-1), 0.0)
    if how == "product":
        return (log_p * mask).sum(-1)
    last = (mask.shape[1] - 1 - mask.flip(1).int().argmax(1)).clamp(min=0)
    return log_p.gather(1, last[:, None]).squeeze(1) * mask.any(-1)


class ProcessRewardModel(nn.Module):
    """A score for every reasoning step (Lightman et al. 2023; Wang et al. 2024, Math-Shepherd): the
    reward model's backbone and 2-layer head, read at the last token of each step instead of the
    last token of the sequence. Step logits -> probabilities of "this step is right"; a response's
    score aggregates them (min | product | last). Saved like a RewardModel plus ``prm_config.json``."""

    CONFIG_FILE = "prm_config.json"

    def __init__(self, model: RewardScorer, tokenizer: Any, step_delimiter: str = "\n",
                 aggregation: str = "min") -> None:
        super().__init__()
        _check_choice(aggregation, PRM_AGGREGATIONS, "prm_aggregation")
        self.model, self.tokenizer = model, tokenizer
        self.step_delimiter, self.aggregation = step_delimiter, aggregation

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, step_delimiter: str | None = None, aggregation: str | None = None,
                        **kwargs: Any) -> ProcessRewardModel:
        reward = RewardModel.from_pretrained(name_or_path, **kwargs)
        path = Path(resolve_model_path(name_or_path, kwargs.get("cache_dir"))) / cls.CONFIG_FILE
        saved = json.loads(path.read_text()) if path.exists() else {}
        return cls(reward.model, reward.tokenizer, step_delimiter or saved.get("step_delimiter", "\n"),
                   aggregation or saved.get("aggregation", "min"))

    def prepare_for_training(self, config: BaseConfig) -> ProcessRewardModel:
        RewardModel(self.model, self.tokenizer).prepare_for_training(config)
        return self

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(parameter_numel(p) for p in self.model.parameters() if p.requires_grad or not trainable_only)

    def step_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    step_positions: torch.Tensor) -> torch.Tensor:
        """Shapes: ids, mask (B, T), step_positions (B, S) -> logits (B, S)."""
        return self.model(input_ids, attention_mask, step_positions)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, step_positions: torch.Tensor,
                step_mask: torch.Tensor) -> torch.Tensor:
        """Aggregated log-probability that every step is right. Shapes: -> (B)."""
        return aggregate_step_scores(self.step_logits(input_ids, attention_mask, step_positions), step_mask,
                                     self.aggregation)

    def save_pretrained(self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        RewardModel(self.model, self.tokenizer).save_pretrained(directory, state_dict=state_dict)
        (Path(directory) / self.CONFIG_FILE).write_text(json.dumps(
            {"step_delimiter": self.step_delimiter, "aggregation": self.aggregation,
             "score": "last token of each step"}, indent=1))

    def load_weights(self, directory: str | os.PathLike) -> None:
        RewardModel(self.model, self.tokenizer).load_weights(directory)


class ValueModel(nn.Module):
    """The PPO critic: a scalar value at every position. Either a head on the policy's own backbone
    (LLaMA-Factory's value head; no second model in memory) or a separate transformer (as in TRL,
    typically started from the reward model). Saved as ``value_head.safetensors``, plus the
    backbone in Hugging Face layout when it is separate."""

    HEAD_FILE = "value_head.safetensors"

    def __init__(self, hidden_size: int, backbone: nn.Module | None = None, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.head = nn.Linear(hidden_size, 1)
            nn.init.normal_(self.head.weight, std=1 / math.sqrt(hidden_size + 1))
            nn.init.zeros_(self.head.bias)

    @property
    def shares_policy_backbone(self) -> bool:
        return self.backbone is None

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, device: torch.device | str = "cpu", seed: int = 0,
                        **kwargs: Any) -> tuple[ValueModel, Any]:
        """A separate critic from any causal-LM or reward-model directory; a saved value head is reloaded."""
        directory = Path(resolve_model_path(name_or_path, kwargs.get("cache_dir")))
        if (directory / RewardEnsemble.MANIFEST).exists() and not (directory / "config.json").exists():
            raise RLHFInputError(f"config field 'value_model': {directory} is a reward-model ensemble; a critic "
                                 f"starts from one model, e.g. {directory / 'member-0'}")
        backbone = PolicyModel.from_pretrained(name_or_path, device=device, **kwargs)
        critic = cls(text_config(backbone.model).hidden_size, backbone.model, seed).to(device)
        head = Path(resolve_model_path(name_or_path, kwargs.get("cache_dir"))) / cls.HEAD_FILE
        if head.exists():
            critic.load_head(head.parent)
        return critic, backbone.tokenizer

    def forward(self, hidden_states: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values from the policy's final hidden states (shared backbone) or from token ids (separate).
        Shapes: hidden (B, T, H) or ids (B, T) -> values (B, T)."""
        if self.backbone is not None:
            hidden_states = decoder_of(self.backbone)(input_ids=input_ids, attention_mask=attention_mask,
                                                      use_cache=False).last_hidden_state
        return scalar_head(self.head, hidden_states)

    def save_pretrained(self, directory: str | os.PathLike, tokenizer: Any = None,
                        state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """``state_dict``: the critic's weights to write instead of its own (a sharded model's, gathered whole)."""

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        backbone_state = state_under(state_dict, "backbone.")
        if self.backbone is not None:
            PolicyModel(self.backbone, tokenizer).save_pretrained(directory, backbone_state) if tokenizer is not None \
                else self.backbone.save_pretrained(directory,
                                                   **({"state_dict": backbone_state} if backbone_state else {}))
        head = state_under(state_dict, "head.") or self.head.state_dict()
        save_file({k: v.detach().contiguous() for k, v in head.items()}, str(directory / self.HEAD_FILE))

    def load_head(self, directory: str | os.PathLike) -> None:
        self.head.load_state_dict(load_file(str(Path(directory) / self.HEAD_FILE)))


class ActorCritic(nn.Module):
    """Policy and critic as one module, so one optimizer, one clipping and one checkpoint cover both.
    A critic sharing the backbone reads the policy's final hidden states from the same forward."""

    def __init__(self, policy_model: nn.Module, critic: ValueModel) -> None:
        super().__init__()
        self.policy, self.critic = policy_model, critic

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shapes: (B, T) -> the policy's OutputHead scores (B, T, V|H), values (B, T)."""
        shared = self.critic.shares_policy_backbone
        scores, out = OutputHead.of(self.policy).scores(self.policy, input_ids=input_ids, attention_mask=attention_mask,
                                                        use_cache=False, output_hidden_states=shared)
        values = (self.critic(hidden_states=out.hidden_states[-1]) if shared
                  else self.critic(input_ids=input_ids, attention_mask=attention_mask))
        return scores, values

def _model_dtype(config: BaseConfig) -> str:
    if config.model_dtype != "auto":
        return config.model_dtype
    if config.finetuning_type == "lora" and config.mixed_precision != "no":
        return "bfloat16" if config.bf16 else "float16"  # frozen base in half precision; adapters stay fp32
    return "float32"


def select_informative_tokens(surprisal: torch.Tensor, ratio: float) -> torch.Tensor:
    """Which tokens to keep: the ceil(ratio x T) with the highest surprisal (ties to the earlier token),
    in their original order. Shapes: (T) -> bool (T)."""
    if not 0 < ratio <= 1:
        raise RLHFInputError(f"compression ratio {ratio} must be in (0, 1]")
    count = surprisal.numel()
    keep = min(count, math.ceil(ratio * count))
    order = sorted(range(count), key=lambda i: (-float(surprisal[i]), i))[:keep]
    mask = torch.zeros(count, dtype=torch.bool)
    mask[order] = True
    return mask


class ContextCompressor:
    """Prompt compression by the policy's own per-token surprisal (the token-level pass of LLMLingua,
    Jiang et al. 2023): a token the model predicts easily from what precedes it carries little
    information, so the context keeps only its ``ratio`` most surprising tokens, in order. The
    question is never compressed. The first token has no prediction and is always kept."""

    def __init__(self, policy: PolicyModel, ratio: float = 0.5) -> None:
        self.policy, self.ratio = policy, ratio
        select_informative_tokens(torch.zeros(1), ratio)  # validate the ratio now

    @torch.no_grad()
    def surprisal(self, ids: list[int]) -> torch.Tensor:
        """-log p(x_t | x_<t) per token under the policy (the first token: +inf). Shapes: (T)."""
        device = next(self.policy.parameters()).device
        logits = self.policy(torch.tensor([ids], device=device)).logits[0, :-1].float()
        nll = -token_log_probs(logits[None], torch.tensor([ids[1:]], device=device))[0]
        return torch.cat([torch.tensor([float("inf")]), nll.cpu()])

    def compress_ids(self, context_ids: list[int], ratio: float | None = None, keep_ids: list[int] = ()) -> list[int]:
        """The context's most informative tokens, then ``keep_ids`` (e.g. the question) untouched."""
        if not context_ids:
            return list(keep_ids)
        mask = select_informative_tokens(self.surprisal(list(context_ids)), self.ratio if ratio is None else ratio)
        return [t for t, kept in zip(context_ids, mask.tolist()) if kept] + list(keep_ids)

    def compress(self, context: str, question: str = "", ratio: float | None = None, separator: str = "\n") -> str:
        """Compressed ``context`` text, then ``separator`` and the ``question`` as written."""
        tokenizer = self.policy.tokenizer
        kept = self.compress_ids(tokenizer(context, add_special_tokens=False)["input_ids"], ratio)
        text = tokenizer.decode(kept, skip_special_tokens=True)
        return f"{text}{separator}{question}" if question else text


class ReferenceModel:
    """The frozen reference policy of DPO/KTO: log-probs only, never trained.

    Either a separate frozen model, or the training policy itself with its LoRA adapter switched
    off (no second copy of the weights in memory).
    """

    def __init__(self, model: PolicyModel, disable_adapter: bool = False) -> None:
        self.model, self.disable_adapter = model, disable_adapter

    def to(self, device: torch.device | str) -> ReferenceModel:
        """Put a separate frozen copy on the training device (trainers call this: a reference built
        before the trainer sits where it was loaded, often the CPU). The adapter-disabled policy is the
        policy itself and moves with it."""
        if not self.disable_adapter:
            self.model.model.to(device)
        return self

    @torch.no_grad()
    def compute_log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                          **vision: torch.Tensor) -> LogProbs:
        with self._frozen():
            return self.model.compute_log_probs(input_ids, attention_mask, labels, **vision)

    @torch.no_grad()
    def shared_prefix_log_probs(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(per_token, mask) of a pair batch with the prompt run once (see shared_prefix_log_probs)."""
        with self._frozen():
            per_token, mask, _ = shared_prefix_log_probs(self.model.model, batch)
            return per_token, mask

    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        module = getattr(self.model.model, "_orig_mod", self.model.model)  # through torch.compile's wrapper
        was_training = module.training
        module.eval()
        try:
            with module.disable_adapter() if self.disable_adapter else contextlib.nullcontext():
                yield
        finally:
            module.train(was_training)


PREFIX_SHARING_EXCLUDED = ("mamba", "mamba2", "rwkv")  # recurrent state, no per-position KV cache to share


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def can_pack_pairs(model: nn.Module) -> bool:
    """Whether the packed tree layout (pack_preference_pairs) gives this model's exact log-probs: its
    attention must take a custom 4D mask (sdpa, eager; flash-attention takes none) and apply no
    sliding window of its own (the custom mask replaces it)."""
    config = innermost_model(model).config
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return (getattr(config, "_attn_implementation", None) in ("sdpa", "eager") and not window
            and config.model_type not in PREFIX_SHARING_EXCLUDED)


def tree_attention_mask(pair: torch.Tensor, branch: torch.Tensor, implementation: str,
                        dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask of packed pair rows: a token sees the earlier tokens of its own pair that are prompt
    or on its own branch (chosen or rejected). Padding (pair -1) sees earlier padding, so no row of
    the mask is empty. Boolean (True = attend) for sdpa, additive for eager, which adds it to the
    scores. Shapes: (R, L) -> (R, 1, L, L)."""
    index = torch.arange(pair.shape[1], device=pair.device)
    causal = index[None, :] <= index[:, None]  # (L, L): key j at or before query i
    same_pair = pair[:, :, None] == pair[:, None, :]
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    allowed = (causal & same_pair & visible)[:, None]
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=pair.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _packed_rows_logits(model: nn.Module, ids: torch.Tensor, position_ids: torch.Tensor, pair: torch.Tensor,
                        branch: torch.Tensor) -> torch.Tensor:
    """One forward of packed tree rows under their ``tree_attention_mask``, flattened: the logits of every
    slot, row after row. Shapes: (R, L) each -> (R*L, V)."""
    inner = innermost_model(model)
    attention = tree_attention_mask(pair, branch, inner.config._attn_implementation,
                                    torch.float32 if torch.is_autocast_enabled(ids.device.type) else inner.dtype)
    scores, _ = OutputHead.of(model).scores(model, input_ids=ids, attention_mask=attention, position_ids=position_ids,
                                            use_cache=False)
    return scores.reshape(-1, scores.shape[-1])


def _packed_pair_log_probs(model: nn.Module, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = _packed_rows_logits(model, batch["packed_input_ids"], batch["packed_position_ids"], batch["packed_pair"],
                               batch["packed_branch"])  # (R*L, V)
    source = batch["packed_source"]  # (2B, C) slot of each token
    completion_ids, mask = batch["completion_input_ids"], batch["completion_attention_mask"]
    head = OutputHead.of(model)
    if head.chunked:  # hidden states are H wide, not V: index them out to the targets directly
        per_token = head.log_probs(flat[source], completion_ids) * mask
    else:
        per_token = _slot_log_probs(flat, source, completion_ids) * mask
    mean_logits = (head.mean_logits(flat)[source] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_token, mask.bool(), mean_logits


def _slot_log_probs(flat_logits: torch.Tensor, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(flat_logits[source])[targets], normalising each packed slot once where it stands.
    Indexing the (slots, V) logits out to every target first would copy a vocabulary-wide row per
    target, and its backward scatters those rows back one by one. Slots go through in chunks of rows
    as in token_log_probs; the values are the same.
    Shapes: flat_logits (S, V), source and targets (N, C) -> (N, C)."""
    slots, vocab = flat_logits.shape
    rows_per_chunk = max(1, LOG_SOFTMAX_CHUNK_ELEMENTS // max(vocab, 1))
    total = None
    for start in range(0, slots, rows_per_chunk):
        chunk = _log_softmax_fp32(flat_logits[start:start + rows_per_chunk])
        picked = chunk[(source - start).clamp(0, len(chunk) - 1), targets]
        if len(chunk) < slots:  # keep only the targets whose slot is in this chunk
            inside = (source >= start) & (source < start + len(chunk))
            picked = torch.where(inside, picked, torch.zeros_like(picked))
        total = picked if total is None else total + picked
    return total if total is not None else flat_logits.new_zeros(targets.shape, dtype=torch.float32)


def _prefill_prompts(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """One forward of left-padded prompts that keeps their KV cache, for completions to continue from.
    Only the last position's scores are needed: the causal LM inside any wrappers (DDP, torch.compile,
    PEFT) is asked for those alone when it takes ``logits_to_keep``, instead of (B, P, V) of them.
    Returns (the last position's OutputHead scores (B, 1, V|H), the model's output)."""
    inner = innermost_model(model)
    extra = {"logits_to_keep": 1} if _takes_logits_to_keep(type(inner)) else {}
    scores, out = OutputHead.of(model).scores(model, input_ids=prompt_ids, attention_mask=prompt_mask,
                                              position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
                                              **extra)
    return scores[:, -1:], out


def shared_prefix_log_probs(model: nn.Module,
                            batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Completion log-probs of chosen and rejected with their shared prompt run once.

    The prompt (left-padded, so every prompt ends in the last column) goes through the model once;
    its KV cache is repeated for the two completions, which attend to it like a concatenated row
    would. Prompt compute is halved, in forward and backward, for the policy and the reference.
    Batch keys from PreferenceCollator(share_prompt=True): prompt_input_ids / prompt_attention_mask
    (B, P), completion_input_ids / completion_attention_mask (2B, C), rows ordered chosen then rejected.
    Returns per_token (2B, C), mask (2B, C) and mean logits over completion tokens (2B).
    A batch in the packed layout (pack_preference_pairs) runs as one forward of its packed rows under
    the tree mask instead: the same values, without a KV cache and without padding between pairs.
    """
    if "packed_input_ids" in batch:
        return _packed_pair_log_probs(model, batch)
    prompt_ids, prompt_mask = batch["prompt_input_ids"], batch["prompt_attention_mask"]
    completion_ids, completion_mask = batch["completion_input_ids"], batch["completion_attention_mask"]
    pairs = prompt_ids.shape[0]
    prompt_last, prompt_out = _prefill_prompts(model, prompt_ids, prompt_mask)
    cache = returned_cache(prompt_out)
    cache.batch_repeat_interleave(2)  # rows p1, p1, p2, p2 ...: chosen and rejected of pair i follow each other
    order = torch.stack([torch.arange(pairs), torch.arange(pairs) + pairs], 1).reshape(-1).to(completion_ids.device)
    ids, mask = completion_ids[order], completion_mask[order]  # (2B, C) interleaved
    prompt_lengths = prompt_mask.sum(-1).repeat_interleave(2)
    longest = int((prompt_lengths + mask.sum(-1)).max())  # padding slots stay inside the longest row's positions
    positions = (prompt_lengths[:, None] + torch.arange(ids.shape[1], device=ids.device)).clamp(max=longest - 1)
    attention = torch.cat([prompt_mask.repeat_interleave(2, 0), mask], 1)
    head = OutputHead.of(model)
    scores, _ = head.scores(model, input_ids=ids, attention_mask=attention, position_ids=positions,
                            **cache_argument(model, cache), use_cache=True)  # (2B, C, .): t predicts token t+1
    scores = torch.cat([prompt_last.repeat_interleave(2, 0), scores[:, :-1]], 1)  # predicts token t
    per_token = head.log_probs(scores, ids) * mask
    mean_logits = (head.mean_logits(scores) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    back = torch.argsort(order)  # interleaved -> chosen rows, then rejected rows
    return per_token[back], mask[back].bool(), mean_logits[back]


def _prompt_groups(input_ids: torch.Tensor, prompt_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive rows with the same prompt form a group. Returns each row's group index (N) and the first
    row of each group (U). Shapes: input_ids (N, T) with the prompt at the start, prompt_lengths (N)."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    in_prompt = columns < prompt_lengths[:, None]
    same_prompt = ((prompt_lengths[1:] == prompt_lengths[:-1])
                   & ((input_ids[1:] == input_ids[:-1]) | ~in_prompt[1:]).all(-1))
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=input_ids.device), ~same_prompt])
    return starts.long().cumsum(0) - 1, starts.nonzero().squeeze(-1)


def _plan_group_packing(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor,
                        hidden_size: int | None) -> dict[str, Any]:
    """Which rows form each group (its prompt once, then its completions one after another: one item of
    ``pack_rows``), how the items fill packed rows, and pack_rows' work estimate for that layout, without
    building it: cheap enough to price the packed layout before choosing it."""
    lengths, prompts = attention_mask.sum(-1).tolist(), prompt_lengths.tolist()
    group, firsts = _prompt_groups(input_ids, prompt_lengths)
    members: list[list[int]] = [[] for _ in range(len(firsts))]
    for row, g in enumerate(group.tolist()):
        members[g].append(row)
    firsts = firsts.tolist()
    item_lengths = [prompts[f] + sum(lengths[n] - prompts[n] for n in members[g]) for g, f in enumerate(firsts)]
    layout = pack_rows(item_lengths, hidden_size)
    width = max(sum(item_lengths[g] for g in row) for row in layout)
    work = _layout_work(len(layout) * width, width, hidden_size) if hidden_size else float("inf")
    return {"groups": len(firsts), "firsts": firsts, "members": members, "layout": layout, "width": width,
            "lengths": lengths, "prompts": prompts, "work": work}


def _pack_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor,
                 pad_token_id: int, hidden_size: int | None, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """The packed tree layout of prompt + completion rows, as ``_plan_group_packing`` plans it: each
    completion is a branch of its own after its group's prompt. ``source`` (N, T-1) is the flat slot whose
    logits stand at each position of the original rows: position t predicts token t+1, so a completion's
    first token reads the prompt's last slot; prompt and padding positions, which the loss masks, read the
    prompt's last slot too. Also returns the plan's ``work`` and ``groups``."""
    plan = plan or _plan_group_packing(input_ids, attention_mask, prompt_lengths, hidden_size)
    layout, width, firsts, members = plan["layout"], plan["width"], plan["firsts"], plan["members"]
    lengths, prompts, ids_rows = plan["lengths"], plan["prompts"], input_ids.tolist()
    ids, positions = [[pad_token_id] * width for _ in layout], [[0] * width for _ in layout]
    pair, branch = [[-1] * width for _ in layout], [[0] * width for _ in layout]
    source = [[0] * (input_ids.shape[1] - 1) for _ in ids_rows]
    for r, row in enumerate(layout):
        cursor = 0
        for g in row:
            p = prompts[firsts[g]]
            ids[r][cursor:cursor + p] = ids_rows[firsts[g]][:p]
            positions[r][cursor:cursor + p] = range(p)
            pair[r][cursor:cursor + p] = [g] * p
            prompt_last = r * width + cursor + p - 1
            cursor += p
            for b, n in enumerate(members[g], start=1):
                c = lengths[n] - p
                ids[r][cursor:cursor + c] = ids_rows[n][p:p + c]
                positions[r][cursor:cursor + c] = range(p, p + c)
                pair[r][cursor:cursor + c], branch[r][cursor:cursor + c] = [g] * c, [b] * c
                source[n] = [prompt_last] * len(source[n])
                source[n][p:p + c - 1] = range(r * width + cursor, r * width + cursor + c - 1)
                cursor += c
    device = input_ids.device
    return {"groups": plan["groups"], "work": plan["work"], "input_ids": torch.tensor(ids, device=device),
            "position_ids": torch.tensor(positions, device=device), "pair": torch.tensor(pair, device=device),
            "branch": torch.tensor(branch, device=device), "source": torch.tensor(source, device=device)}


def _prefix_layout_work(attention_mask: torch.Tensor, prompt_lengths: torch.Tensor, groups: int,
                        hidden_size: int) -> float:
    """pack_rows' work estimate for grouped_prefix_logits: the prompts' forward (groups x longest prompt)
    and the completions' (rows x longest completion, attending to the prompt too)."""
    prompt = int(prompt_lengths.max())
    completion = max(1, int((attention_mask.sum(-1) - prompt_lengths).max()))
    return (_layout_work(groups * prompt, prompt, hidden_size)
            + _layout_work(len(prompt_lengths) * completion, prompt + completion, hidden_size))


def grouped_packed_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          prompt_lengths: torch.Tensor, pad_token_id: int = 0, hidden_size: int | None = None,
                          layout: dict[str, Any] | None = None) -> torch.Tensor:
    """What grouped_prefix_logits returns, computed in the packed tree layout (``_pack_groups``): no padding
    between completions, each group's prompt once, and every completion attending to its prompt and
    itself (``tree_attention_mask`` with one branch per completion), its positions continuing from the
    prompt's end, so each token sees what it would in its own row. Needs ``can_pack_pairs(model)``.
    Shapes: input_ids, attention_mask (N, T) right-padded, prompt_lengths (N) -> (N, T-1, V)."""
    packed = layout or _pack_groups(input_ids, attention_mask, prompt_lengths, pad_token_id, hidden_size)
    flat = _packed_rows_logits(model, packed["input_ids"], packed["position_ids"], packed["pair"], packed["branch"])
    return flat[packed["source"]]


def grouped_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   prompt_lengths: torch.Tensor, *, pad_token_id: int = 0, pack: bool = False,
                   agree: Callable[[bool], bool] | None = None) -> torch.Tensor:
    """Logits of prompt + completion rows with each group's prompt run once: by ``grouped_packed_logits``
    when ``pack`` (and the model can) and its layout is less work than ``grouped_prefix_logits``' padded
    completion rows, else by the latter. Completions of uneven length (short and long answers in one
    batch) favour the packed layout; completions that all run to the length limit favour the KV cache,
    whose attention spans one row instead of a whole packed one. The two run different numbers of forwards (one;
    the prompts', then the completions'), and a model across processes (DDP, FSDP, ZeRO-3) makes collectives in
    each: ``agree`` turns this process's choice into the one every process takes."""
    hidden_size = getattr(text_config(model), "hidden_size", None)
    if pack and hidden_size and can_pack_pairs(model):
        plan = _plan_group_packing(input_ids, attention_mask, prompt_lengths, hidden_size)
        packs = plan["work"] < _prefix_layout_work(attention_mask, prompt_lengths, plan["groups"], hidden_size)
        if agree(packs) if agree is not None else packs:
            layout = _pack_groups(input_ids, attention_mask, prompt_lengths, pad_token_id, hidden_size, plan)
            return grouped_packed_logits(model, input_ids, attention_mask, prompt_lengths, layout=layout)
    return grouped_prefix_logits(model, input_ids, attention_mask, prompt_lengths)


def grouped_prefix_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          prompt_lengths: torch.Tensor) -> torch.Tensor:
    """Next-token logits of prompt + completion rows with each distinct prompt run once.

    Online RL samples G completions per prompt; consecutive rows with the same prompt form a group.
    The distinct prompts (left-padded, so each ends in the last column) go through the model once,
    their KV cache is indexed out to every row of the group, and only the completions run per row:
    prompt compute drops G-fold in forward and backward. Rows may hold uneven groups (a micro-batch can
    split one). Returns logits laid out like ``model(input_ids).logits[:, :-1]`` (position t predicts
    token t+1) at every completion position; earlier positions, which the loss masks, hold the
    prompt's last logits. Shapes: input_ids, attention_mask (N, T) right-padded, prompt_lengths (N)
    -> (N, T-1, V).
    """
    rows, width = input_ids.shape
    device = input_ids.device
    columns = torch.arange(width, device=device)
    group, firsts = _prompt_groups(input_ids, prompt_lengths)
    lengths = prompt_lengths[firsts]
    prompt_width = int(lengths.max())
    source = torch.arange(prompt_width, device=device) - (prompt_width - lengths[:, None])  # (U, P): left padding
    prompt_mask = (source >= 0).long()
    prompt_ids = input_ids[firsts].gather(1, source.clamp(min=0))  # padding columns repeat token 0, masked
    prompt_last, prompt_out = _prefill_prompts(model, prompt_ids, prompt_mask)
    cache = returned_cache(prompt_out)
    cache.batch_select_indices(group)  # differentiable indexing: gradients of every row reach its prompt
    completion_width = max(1, int((attention_mask.sum(-1) - prompt_lengths).max()))
    offsets = prompt_lengths[:, None] + torch.arange(completion_width, device=device)  # (N, C) columns of the rows
    # padding slots stay inside the rows' width, as columns and as positions: learned position tables (GPT-2) end there
    inside = offsets.clamp(max=width - 1)
    completion_ids = input_ids.gather(1, inside)
    completion_mask = attention_mask.gather(1, inside) * (offsets < width)
    logits, _ = OutputHead.of(model).scores(model, input_ids=completion_ids, position_ids=inside, use_cache=True,
                                            attention_mask=torch.cat([prompt_mask[group], completion_mask], 1),
                                            **cache_argument(model, cache))  # (N, C, V|H)
    logits = torch.cat([prompt_last[group], logits[:, :-1]], 1)  # column j predicts completion token j
    back = (columns[:-1] + 1 - prompt_lengths[:, None]).clamp(0, completion_width - 1)  # (N, T-1)
    return logits.gather(1, back[..., None].expand(-1, -1, logits.shape[-1]))


def _load_policy(config: BaseConfig, device: torch.device | str, model: str | None = None) -> PolicyModel:
    """The stage's model (or ``model``, another directory) loaded with the stage's dtype and attention."""
    return PolicyModel.from_pretrained(model or config.model_name_or_path, dtype=_model_dtype(config),
                                       attn_implementation=config.attn_implementation,
                                       trust_remote_code=config.trust_remote_code, device=device,
                                       cache_dir=config.cache_dir, quantization=quantization_config(config))


def create_reference_model(config: BaseConfig, policy: PolicyModel) -> ReferenceModel | None:
    """LLaMA-Factory's rules: no reference for reference-free losses (ORPO, SimPO); an explicit
    ``ref_model``; for adapter training the policy with its adapter disabled; otherwise a frozen
    copy of the starting policy. Call before training starts (the copy must be of the start)."""
    if not getattr(config, "uses_reference", True):
        return None
    if getattr(config, "ref_model", None):
        reference = PolicyModel.from_pretrained(config.ref_model, dtype=_model_dtype(config), device=policy.device,
                                                field="ref_model",
                                                attn_implementation=config.attn_implementation, is_trainable=False,
                                                quantization=quantization_config(config),
                                                trust_remote_code=config.trust_remote_code, cache_dir=config.cache_dir)
        reference.model.requires_grad_(False).eval()
        return ReferenceModel(reference)
    if config.finetuning_type in ("lora", "oft") and not policy.is_peft:
        return ReferenceModel(policy, disable_adapter=True)  # the adapter is added by prepare_for_training
    # full / freeze training, or continuing an existing adapter: the start must be kept as it is
    if weight_sharding(policy.model) == "zero3":  # built partitioned (zero3_init_flag): a copy of the start, whole
        frozen = _load_policy(config, policy.device)
        frozen.model.requires_grad_(False).eval()
        return ReferenceModel(frozen)
    frozen = PolicyModel(copy.deepcopy(policy.model).requires_grad_(False).eval(), policy.tokenizer,
                         vision=policy.vision)
    return ReferenceModel(frozen)


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0 (TRL's ``disable_dropout``): stored rollout log-probs, values and
    reference log-probs must come from the same deterministic function as the loss. Besides dropout layers,
    transformers' attention modules keep their probability as a float, ``attention_dropout``, that they pass to
    the attention kernel in training mode (Llama, Qwen, Mistral, Gemma, Phi-3, GPT-NeoX)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


# The finetuning type of a model: adapters here (LoRA or OFT, which on a vision-language model keep to the parts
# that train, section 5), freezing in section 2 (apply_freeze), both applied by _prepare_backbone.
# PEFT refuses LoRA on Mamba's out_proj (its fused kernel reads the weight directly) and on conv1d.
_PEFT_REFUSED_TARGETS = {"mamba": ("out_proj", "conv1d"), "mamba2": ("out_proj", "conv1d")}


def _model_type(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", "")


def apply_lora(model: nn.Module, config: BaseConfig) -> nn.Module:
    """Wrap the model with PEFT LoRA adapters on ``lora_target`` (``all`` = every linear layer)."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    available, experts = find_linear_module_names(model), find_expert_parameter_names(model)
    if config.lora_target.strip() == "all" and is_vision_language(model):
        targets, parameters = lora_target_names(model, config, available), experts
    elif config.lora_target.strip() == "all":
        targets = [t for t in available if t not in _PEFT_REFUSED_TARGETS.get(_model_type(model), ())]
        parameters = experts
    else:
        named = [t.strip() for t in config.lora_target.split(",") if t.strip()]
        expert_of = {e: e for e in experts} | {e.rsplit(".", 1)[-1]: e for e in experts
                                               if e.rsplit(".", 1)[-1] not in available}
        parameters = [expert_of[t] for t in named if t in expert_of]  # 'experts.down_proj' or plain 'down_proj'
        targets = [t for t in named if t not in expert_of]
        missing = [t for t in targets if t not in available]
        if missing:
            raise RLHFInputError(f"config field 'lora_target': {', '.join(missing)} not found in the model; "
                                 f"linear layers are: {', '.join(available)}"
                                 + (f"; expert weights: {', '.join(experts)}" if experts else "") + " (or use 'all')")
    if parameters and config.finetuning_type == "oft":
        raise RLHFInputError(f"config field 'finetuning_type': OFT cannot adapt the fused expert weights "
                             f"({', '.join(parameters)}) of this mixture-of-experts model; use lora, or list the "
                             f"linear layers in lora_target")
    logger.info("%s targets: %s%s", config.finetuning_type.upper(),
                ", ".join(sorted({t.rsplit(".", 1)[-1] for t in targets})) or "no linear layer",
                f"; expert weights {', '.join(parameters)} (each expert its own low-rank update; the router stays "
                f"frozen)" if parameters else "")
    conv1d = any(isinstance(m, Conv1D) and n.rsplit(".", 1)[-1] in targets for n, m in model.named_modules())
    extra = [t.strip() for t in (config.additional_target or "").split(",") if t.strip()] or None
    if config.finetuning_type == "oft":  # orthogonal fine-tuning (Qiu et al. 2023): same targets, OFT blocks
        from peft import OFTConfig

        adapter = OFTConfig(r=config.lora_rank, oft_block_size=0, target_modules=targets, modules_to_save=extra,
                            module_dropout=config.lora_dropout, task_type="CAUSAL_LM", fan_in_fan_out=conv1d)
    else:
        adapter = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                             target_modules=targets, target_parameters=parameters or None, modules_to_save=extra,
                             task_type="CAUSAL_LM", fan_in_fan_out=conv1d)
    try:
        with _peft_deprecation_quiet():
            return get_peft_model(model, adapter)
    except ValueError as err:  # e.g. a module type PEFT cannot adapt on this architecture
        raise RLHFInputError(f"config field 'lora_target' ({', '.join(targets)}): {err}") from None


def _prepare_backbone(model: nn.Module, config: BaseConfig) -> nn.Module:
    """Apply ``disable_dropout``, the finetuning type (LoRA / OFT / freeze / full) and gradient checkpointing.
    Dropout goes before the adapter is added, so that an explicit ``lora_dropout`` is kept."""
    if config.disable_dropout:
        disable_dropout(model)
    if is_quantized(model) and not hasattr(model, "peft_config"):  # QLoRA (Dettmers et al. 2023), as PEFT prepares it:
        from peft import prepare_model_for_kbit_training  # frozen base, norms and embeddings in fp32, input grads on

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=config.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.finetuning_type in ("lora", "oft") and not hasattr(model, "peft_config"):
        model = apply_lora(model, config)
    elif config.finetuning_type == "freeze":
        apply_freeze(model, config.freeze_trainable_layers)
    if is_vision_language(model):
        set_trainable_parts(model, config)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "peft_config"):
            model.enable_input_require_grads()
    return model


def _log_trainable(trainable: int, total: int, finetuning_type: str) -> None:
    logger.info("trainable parameters: %s of %s (%.2f%%, %s)", f"{trainable:,}", f"{total:,}",
                100 * trainable / max(total, 1), finetuning_type)


# ==== 7. Losses and advantages ====


def router_load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int,
                               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary load-balancing loss (Fedus et al. 2022, eq. 4), as Mixtral and Qwen3-MoE
    train with it: E * sum_e f_e * P_e over the tokens of every MoE layer, where f_e is the share of the top-k
    routing slots that go to expert e (per slot) and P_e the mean router probability of e. It is top_k when
    routing is uniform and grows as tokens crowd onto few experts. Padding tokens (mask 0) do not count.
    Shapes: router_logits, one (B*T, E) per layer; attention_mask (B, T) -> scalar."""
    logits = torch.cat([layer.float() for layer in router_logits], 0)  # (L*B*T, E)
    experts = logits.shape[-1]
    probabilities = logits.softmax(-1)
    chosen = F.one_hot(probabilities.topk(top_k, -1).indices, experts).float()  # (N, k, E)
    weight = torch.ones(logits.shape[0], device=logits.device)
    if attention_mask is not None:
        weight = attention_mask.reshape(-1).float().repeat(len(router_logits)).to(logits.device)
    total = weight.sum().clamp_min(1.0)
    slot_share = (chosen * weight[:, None, None]).sum(0) / total  # (k, E)
    mean_probability = (probabilities * weight[:, None]).sum(0) / total  # (E)
    return experts * (slot_share * mean_probability[None]).sum()


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over target tokens and how many there were.

    Returning the sum (not the mean) lets the trainer divide by the target-token count of the whole
    accumulated batch, so batch 8 x accumulation 1 and batch 1 x accumulation 8 give the same update.
    Shapes: logits (B, T, V), labels (B, T) with IGNORE_INDEX on non-targets -> (scalar, int).
    """
    shifted_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shifted_labels = labels[:, 1:].reshape(-1)
    loss = F.cross_entropy(shifted_logits, shifted_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((shifted_labels != IGNORE_INDEX).sum())


def causal_lm_loss_with(head: OutputHead, scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``causal_lm_loss_sum`` from an OutputHead's scores: with a chunked head only the target positions go
    through the output layer, so neither the prompt's logits nor a whole (B, T, V) tensor is ever made."""
    if not head.chunked:
        return causal_lm_loss_sum(scores, labels)
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    return -head.log_probs(scores[:, :-1][keep], targets[keep]).sum(), int(keep.sum())


# -- preference losses (docs/architecture.md: pure functions, each citing its paper). Each returns per-example
# losses [B]; the caller reduces.
# Rewards are the implicit DPO rewards beta * (policy - reference) log-probs, detached, as TRL logs them.


def sequence_log_probs(per_token: torch.Tensor, mask: torch.Tensor, ld_alpha: float | None = None) -> torch.Tensor:
    """Summed completion log-probs of a concatenated [chosen; rejected] batch. With ``ld_alpha``
    (LD-DPO, Liu et al. 2024 eq. 9) tokens beyond the pair's shared length count alpha times, so
    the longer response's extra tokens stop dominating the margin.
    Shapes: per_token, mask (2B, T-1) -> (2B)."""
    if ld_alpha is None:
        return per_token.sum(-1)
    lengths = mask.sum(-1)
    half = per_token.shape[0] // 2
    shared = torch.minimum(lengths[:half], lengths[half:]).repeat(2)  # (2B)
    position = mask.cumsum(-1)  # 1-based index among completion tokens
    weights = torch.where(position <= shared[:, None], 1.0, ld_alpha) * mask
    return (per_token * weights).sum(-1)


def _smoothed_logsigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def _dpo_sigmoid(c, r, beta, label_smoothing, delta):
    """DPO, Rafailov et al. 2023 eq. 7; with label_smoothing > 0 the conservative cDPO of Mitchell 2023."""
    return _smoothed_logsigmoid_loss(beta * (c - r), label_smoothing)


def _dpo_robust(c, r, beta, label_smoothing, delta):
    """Robust DPO, Chowdhury et al. 2024 eq. 6: unbiased under label-flip rate ``label_smoothing``."""
    logits = beta * (c - r)
    return (-F.logsigmoid(logits) * (1 - label_smoothing) + F.logsigmoid(-logits) * label_smoothing) / (
        1 - 2 * label_smoothing)


def _dpo_hinge(c, r, beta, label_smoothing, delta):
    """SLiC-HF hinge, Zhao et al. 2023 eq. 2 with margin 1/beta (scaled by beta)."""
    return torch.relu(1 - beta * (c - r))


def _dpo_ipo(c, r, beta, label_smoothing, delta):
    """IPO, Azar et al. 2023 eq. 17: squared distance of the log-ratio margin from 1/(2 beta). As in
    TRL, the log-ratios are per-token averages (dpo_loss divides by the lengths), which keeps the
    1/(2 beta) target on the same scale for short and long responses."""
    return (c - r - 1 / (2 * beta)) ** 2


def _dpo_kto_pair(c, r, beta, label_smoothing, delta):
    """KTO on paired data, Ethayarajh et al. 2024 eq. 8 with the batch's mean log-ratios as the KL
    reference points; the two halves are averaged so the batch mean matches TRL's 2B-term mean."""
    chosen_kl = c.mean().clamp(min=0).detach()
    rejected_kl = r.mean().clamp(min=0).detach()
    return 0.5 * ((1 - torch.sigmoid(beta * (c - rejected_kl))) + (1 - torch.sigmoid(beta * (chosen_kl - r))))


def _dpo_bco_pair(c, r, beta, label_smoothing, delta):
    """BCO on pairs, Jung et al. 2024 eq. 7: binary classification of chosen vs rejected implicit
    rewards around a reward shift delta (a running mean in the trainer; the batch mean by default)."""
    chosen_rewards, rejected_rewards = beta * c, beta * r
    if delta is None:
        delta = torch.cat([chosen_rewards, rejected_rewards]).mean().detach()
    return -F.logsigmoid(chosen_rewards - delta) - F.logsigmoid(-(rejected_rewards - delta))


def _dpo_exo_pair(c, r, beta, label_smoothing, delta):
    """EXO, Ji et al. 2024 eq. 15 with K=2: reverse KL between the policy's pairwise preference and
    the smoothed label distribution (label_smoothing 1e-3 when 0 is given)."""
    eps = label_smoothing or 1e-3
    logits = beta * (c - r)
    return (torch.sigmoid(logits) * (F.logsigmoid(logits) - math.log(1 - eps))
            + torch.sigmoid(-logits) * (F.logsigmoid(-logits) - math.log(eps)))


def _dpo_nca_pair(c, r, beta, label_smoothing, delta):
    """NCA, Chen et al. 2024 eq. 11: absolute likelihood of the chosen response, not just the margin."""
    chosen_rewards, rejected_rewards = beta * c, beta * r
    return -F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards) - 0.5 * F.logsigmoid(-rejected_rewards)


def _dpo_sppo_hard(c, r, beta, label_smoothing, delta):
    """SPPO with hard labels, Wu et al. 2024 eq. 4.7: push chosen log-ratio to +1/(2 beta), rejected to -1/(2 beta)."""
    return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2


def _dpo_apo_zero(c, r, beta, label_smoothing, delta):
    """APO-zero, D'Oosterlinck et al. 2024 eq. 5: raise chosen likelihood, lower rejected (for
    chosen outputs better than the model's own)."""
    return (1 - torch.sigmoid(beta * c)) + torch.sigmoid(beta * r)


def _dpo_apo_down(c, r, beta, label_smoothing, delta):
    """APO-down, D'Oosterlinck et al. 2024 eq. 6: lower both likelihoods, the rejected more (for
    chosen outputs worse than the model's own)."""
    return torch.sigmoid(beta * c) + (1 - torch.sigmoid(beta * (c - r)))


PREFERENCE_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "sigmoid": _dpo_sigmoid, "hinge": _dpo_hinge, "ipo": _dpo_ipo, "kto_pair": _dpo_kto_pair,
    "robust": _dpo_robust, "bco_pair": _dpo_bco_pair, "exo_pair": _dpo_exo_pair, "nca_pair": _dpo_nca_pair,
    "sppo_hard": _dpo_sppo_hard, "apo_zero": _dpo_apo_zero, "apo_down": _dpo_apo_down,
}


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             reference_chosen_logps: torch.Tensor, reference_rejected_logps: torch.Tensor, *, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None, bco_delta: torch.Tensor | float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DPO family on summed sequence log-probs (``loss_type`` names in ``PREFERENCE_LOSSES``).

    c = policy_chosen - reference_chosen and r = policy_rejected - reference_rejected are the
    log-ratios; ``ipo`` divides them by the completion lengths (as TRL does). ``bco_delta`` is BCO's reward shift
    (default: this batch's mean reward).
    Shapes: every input (B) -> losses (B), chosen_rewards (B), rejected_rewards (B).
    """
    if loss_type not in PREFERENCE_LOSSES:
        raise RLHFInputError(f"unknown DPO loss_type '{loss_type}'; valid: {', '.join(PREFERENCE_LOSSES)}")
    chosen_logratios = policy_chosen_logps - reference_chosen_logps
    rejected_logratios = policy_rejected_logps - reference_rejected_logps
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise RLHFInputError("dpo_loss(loss_type='ipo') needs chosen_lengths and rejected_lengths "
                                 "(IPO is defined on per-token averaged log-ratios)")
        chosen_logratios = chosen_logratios / chosen_lengths.clamp(min=1)
        rejected_logratios = rejected_logratios / rejected_lengths.clamp(min=1)
    losses = PREFERENCE_LOSSES[loss_type](chosen_logratios, rejected_logratios, beta, label_smoothing, bco_delta)
    return losses, (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach()


def simpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, *, beta: float = 2.0,
               gamma: float = 0.5, label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO, Meng et al. 2024 eq. 6: reference-free margin of length-averaged log-probs with a
    target reward margin gamma: logits = beta * (c - r) - gamma.
    Shapes: averaged log-probs (B) -> losses (B), chosen_rewards (B), rejected_rewards (B).
    """
    logits = beta * (policy_chosen_logps - policy_rejected_logps) - gamma
    losses = _smoothed_logsigmoid_loss(logits, label_smoothing)
    return losses, (beta * policy_chosen_logps).detach(), (beta * policy_rejected_logps).detach()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, *, beta: float = 0.1
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term, Hong et al. 2024 eq. 6-7: -beta * log sigmoid(log odds(chosen) -
    log odds(rejected)) with odds(y) = P(y) / (1 - P(y)) on length-averaged log-probs. The trainer
    adds the chosen responses' NLL. Averages are clamped just below 0 so P = 1 stays finite.
    Shapes: averaged log-probs (B) -> losses (B), chosen_rewards (B), rejected_rewards (B), log_odds (B).
    """
    chosen = policy_chosen_logps.clamp(max=-1e-6)
    rejected = policy_rejected_logps.clamp(max=-1e-6)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    losses = -beta * F.logsigmoid(log_odds)
    return losses, (beta * policy_chosen_logps).detach(), (beta * policy_rejected_logps).detach(), log_odds.detach()


def kto_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor | float, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO, Ethayarajh et al. 2024 eq. 8: a desirable output's value is sigmoid(beta * (logratio -
    z0)), an undesirable one's sigmoid(beta * (z0 - logratio)), with the reference point z0 the batch
    KL estimate (detached, clamped at 0); loss = weight * (1 - value).
    Shapes: policy_logps, reference_logps (B), desirable bool (B), kl scalar -> losses (B), rewards (B).
    """
    logratios = policy_logps - reference_logps
    z0 = torch.as_tensor(kl, dtype=logratios.dtype, device=logratios.device).detach().clamp(min=0)
    desirable = desirable.to(torch.bool)
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios))))
    return losses, (beta * logratios).detach()


def reward_model_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                      margin: torch.Tensor | float | None = None) -> torch.Tensor:
    """Pairwise Bradley-Terry loss, Ouyang et al. 2022 eq. 1; the optional margin is Llama 2's
    (Touvron et al. 2023 eq. 2): -log sigmoid(chosen - rejected - margin).
    Shapes: scores (B), margin (B) or scalar -> losses (B).
    """
    margin = 0.0 if margin is None else margin
    return -F.logsigmoid(chosen_scores - rejected_scores - margin)


def reward_boosting_weights(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                            margin: torch.Tensor | float | None = None) -> torch.Tensor:
    """How much each pair should weigh for the next member of a boosted reward-model ensemble: the
    negative gradient of the pairwise loss with respect to the ensemble's score difference,
    sigmoid(-(chosen - rejected - margin)), i.e. the Bradley-Terry probability that the ensemble so far
    ranks the pair wrong. Reweighting examples by the loss gradient is boosting as functional gradient
    descent (Mason et al. 2000, AnyBoost; for the logistic loss, Friedman 2001's pseudo-residual).
    Shapes: scores (B), margin (B) or scalar -> weights (B) in (0, 1)."""
    margin = 0.0 if margin is None else margin
    return torch.sigmoid(-(chosen_scores - rejected_scores - margin))


def ewc_penalty(parameters: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor],
                fisher: dict[str, torch.Tensor], ewc_lambda: float) -> torch.Tensor:
    """Elastic weight consolidation, Kirkpatrick et al. 2017 eq. 3: lambda/2 * sum_i F_i (theta_i -
    theta*_i)^2, a quadratic pull towards the anchor weights theta* (the model before this stage),
    stiffest where the diagonal Fisher F says the earlier task's likelihood is most sensitive.
    Shapes: three dicts of same-shaped tensors keyed by parameter name -> scalar (fp32)."""
    total = torch.zeros((), dtype=torch.float32, device=next(iter(parameters.values())).device)
    for name, value in parameters.items():
        total = total + (fisher[name] * (value.float() - anchors[name]) ** 2).sum()
    return 0.5 * ewc_lambda * total


class ElasticWeightConsolidation:
    """EWC (Kirkpatrick et al. 2017): remember which weights mattered for an earlier skill and pull
    them back towards their old values while a later stage trains, so preference or RL optimisation
    does not erase what SFT taught. ``from_data`` estimates the diagonal Fisher as the mean squared
    per-example gradient of the example's log-likelihood log p(response | prompt) (the sum over its
    target tokens; the empirical Fisher, one example at a time so each gradient is that example's
    own); ``penalty`` is :func:`ewc_penalty` on the current weights. Only trainable parameters take
    part (with LoRA: the adapter weights).

    Scale: Fisher entries are small, so useful ``ewc_lambda`` values are large (1e4 is a start for a
    small model); watch the logged ``ewc/penalty`` against the stage's loss."""

    FILE = "ewc.safetensors"

    def __init__(self, anchors: dict[str, torch.Tensor], fisher: dict[str, torch.Tensor], ewc_lambda: float,
                 source: dict[str, str] | None = None) -> None:
        if set(anchors) != set(fisher) or not anchors:
            raise ValueError("EWC needs one anchor and one Fisher tensor for each of the same parameters")
        self.anchors, self.fisher, self.ewc_lambda, self.source = anchors, fisher, ewc_lambda, source or {}

    @classmethod
    def from_data(cls, model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], ewc_lambda: float, *,
                  source: dict[str, str] | None = None) -> ElasticWeightConsolidation:
        """Anchor = the model's trainable weights now; Fisher from ``batches`` (one example each)."""
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        fisher = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
        was_training, count = model.training, 0
        model.eval()  # dropout off: the Fisher of the model as it is, not of a random sub-network
        for batch in batches:
            model.zero_grad(set_to_none=True)
            head = OutputHead.of(model)
            scores, _ = head.scores(model, input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
            loss_sum, units = causal_lm_loss_with(head, scores, batch["labels"])
            if not units:
                continue
            loss_sum.backward()  # the sequence's log-likelihood: the Fisher is of p(response | prompt)
            for name, p in params.items():
                if p.grad is not None:
                    fisher[name] += p.grad.detach().float() ** 2
            count += 1
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        if not count:
            raise RLHFInputError("config field 'ewc_dataset': no example with a target token to estimate the Fisher "
                                 "from")
        anchors = {name: p.detach().float().clone() for name, p in params.items()}
        return cls(anchors, {name: f / count for name, f in fisher.items()}, ewc_lambda, source)

    def penalty(self, model: nn.Module) -> torch.Tensor:
        params = {name: p for name, p in model.named_parameters() if name in self.fisher}
        if len(params) != len(self.fisher):
            raise RLHFInputError("EWC: the model's trainable parameters differ from the ones the Fisher was "
                                 "computed for; delete ewc.safetensors in output_dir to recompute it")
        device = next(iter(params.values())).device
        if next(iter(self.fisher.values())).device != device:
            self.anchors = {k: v.to(device) for k, v in self.anchors.items()}
            self.fisher = {k: v.to(device) for k, v in self.fisher.items()}
        return ewc_penalty(params, self.anchors, self.fisher, self.ewc_lambda)

    @classmethod
    def for_stage(cls, config: BaseConfig, policy: PolicyModel, model: nn.Module, devices: DeviceManager,
                  output_dir: Path) -> ElasticWeightConsolidation | None:
        """A stage's EWC (``ewc_lambda`` > 0; else None): the anchor and Fisher of the weights it starts from
        (``model``, as prepared), computed once on ``ewc_dataset`` and kept in ``output_dir``, so a resumed run anchors
        to the same weights."""
        if not getattr(config, "ewc_lambda", 0.0):
            return None
        if devices.uses_deepspeed:  # the Fisher is read from each parameter's own gradient
            raise RLHFInputError("config field 'ewc_lambda' is not supported under DeepSpeed, which partitions the "
                                 "gradients EWC's Fisher is read from; launch with DDP or FSDP2 "
                                 "(configs/accelerate/fsdp.yaml), or set ewc_lambda=0")
        path = output_dir / cls.FILE
        source = {"model": str(config.model_name_or_path), "dataset": config.ewc_dataset,
                  "samples": str(config.ewc_samples)}
        fresh_start = config.overwrite_output_dir or config.resume_from_checkpoint == "none"
        if path.exists() and not fresh_start:
            ewc = cls.load(path, config.ewc_lambda)
            if ewc.source == source:
                return ewc
        started = time.time()
        records = load_records(config.ewc_dataset, config.dataset_dir, "sft", max_samples=config.ewc_samples,
                               skip_invalid=config.skip_invalid_records)
        formatter = chat_formatter(policy.tokenizer, config, policy)
        examples = SFTDataset(records, policy.tokenizer, formatter, cutoff_len=config.cutoff_len,
                              cache_dir=config.cache_dir)
        collate = SFTCollator(policy.tokenizer.pad_token_id, vision=policy.vision)
        batches = ({k: v.to(devices.device) for k, v in collate([examples[i]]).items()} for i in range(len(examples)))
        ewc = cls.from_data(devices.unwrap(model), batches, config.ewc_lambda, source=source)
        if devices.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            ewc.save(path)
        devices.wait()
        logger.info("EWC: diagonal Fisher from %d examples of %s in %.1fs (lambda %g)", len(examples),
                    config.ewc_dataset, time.time() - started, config.ewc_lambda)
        return ewc

    def save(self, path: str | os.PathLike) -> None:
        """anchor/<name> and fisher/<name> tensors in one safetensors file, written atomically."""

        path = Path(path)
        tensors = {**{f"anchor/{k}": v.contiguous() for k, v in self.anchors.items()},
                   **{f"fisher/{k}": v.contiguous() for k, v in self.fisher.items()}}
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        save_file(tensors, str(tmp), metadata=self.source)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, ewc_lambda: float) -> ElasticWeightConsolidation:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            source = handle.metadata() or {}
        anchors = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("anchor/")}
        fisher = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("fisher/")}
        return cls(anchors, fisher, ewc_lambda, source)


# -- online RL: advantages, policy and value losses (docs/architecture.md: pure functions, each citing its paper) ------


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: far outside any clip range, far inside float32


def _clamped_log_ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a - b clamped before it is exponentiated, so one stale or corrupt token cannot overflow to inf."""
    return (a - b).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, shift_mean: bool = True, *,
           sum_across_processes: Callable[[list[float]], list[float]] | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked elements, with the unbiased variance (as TRL's
    masked_whiten); ``shift_mean=False`` keeps the original mean (used for rewards).

    ``sum_across_processes`` (element-wise sums of a list over all processes) makes every process use
    the moments of the whole batch, as one process holding all of it would, instead of its own share's
    (OpenRLHF whitens across ranks the same way). Two collectives: the sum and count, then the squares."""
    mask = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    total, count = (x * mask).sum(), mask.sum()
    if sum_across_processes is not None:
        total, count = x.new_tensor(sum_across_processes([float(total), float(count)]))
    mean = total / count.clamp(min=1)
    squares = (((x - mean) ** 2) * mask).sum()
    if sum_across_processes is not None:
        squares = x.new_tensor(sum_across_processes([float(squares)])[0])
    var = squares / (count - 1).clamp(min=1)
    if var <= (1e-6 * mean.abs()) ** 2:  # a constant (up to float rounding) has no spread to scale: all at the mean
        return torch.zeros_like(x) if shift_mean else torch.ones_like(x) * mean
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "group") -> torch.Tensor:
    """GRPO's group-relative advantages, Shao et al. 2024 eq. 3 (sec. 4.1.2): each reward minus its
    group's mean, divided by the group's std (``group``), the whole batch's std (``batch``, Liu et
    al. 2025's fix for difficulty bias) or not at all (``none``); std is torch's (unbiased), + 1e-4.
    Shapes: rewards (B*G) with each prompt's G completions contiguous -> (B*G)."""
    if scale not in REWARD_SCALES:
        raise RLHFInputError(f"grpo_advantages scale '{scale}'; valid: {', '.join(REWARD_SCALES)}")
    if rewards.numel() % group_size:
        raise RLHFInputError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # (B, G)
    centred = (grouped - grouped.mean(-1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    std = grouped.std(-1, keepdim=True).expand_as(grouped).reshape(-1) if scale == "group" else rewards.std()
    return centred / (std + 1e-4)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to basics", eq. 7): each reward
    minus the mean of the other G - 1 rewards of its group, an unbiased baseline because it does not depend on
    the completion it scores; equal to G / (G - 1) times the reward minus the group's mean.
    Shapes: rewards (B*G) with each prompt's G completions contiguous -> (B*G)."""
    if group_size < 2 or rewards.numel() % group_size:
        raise RLHFInputError(f"{rewards.numel()} rewards do not split into groups of {group_size} (RLOO needs G >= 2)")
    grouped = rewards.view(-1, group_size)  # (B, G)
    others = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def overlong_penalty(lengths: torch.Tensor, max_completion_length: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), a reward added to each completion: 0 up to
    L_max - buffer tokens, then falling linearly to -penalty_factor at L_max, -penalty_factor beyond.
    Shapes: lengths (B) -> (B)."""
    lengths = lengths.to(torch.float32)
    if buffer_len <= 0:
        return torch.zeros_like(lengths)
    start = max_completion_length - buffer_len
    return -penalty_factor * ((lengths - start) / buffer_len).clamp(0.0, 1.0)


def _scaled(advantages: torch.Tensor, group_size: int, scale: str) -> torch.Tensor:
    """Advantages divided by their group's std (``group``), the batch's (``batch``) or kept (``none``), + 1e-4."""
    if scale == "none":
        return advantages
    grouped = advantages.view(-1, group_size)
    std = grouped.std(-1, keepdim=True).expand_as(grouped).reshape(-1) if scale == "group" else advantages.std()
    return advantages / (std + 1e-4)


def reinforce_pp_advantages(scores: torch.Tensor, mask: torch.Tensor, *, kl: torch.Tensor | None = None,
                            kl_coef: float = 0.0, group_size: int | None = None,
                            sum_across_processes: Callable[[list[float]], list[float]] | None = None) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025): per-token rewards -kl_coef * kl, with the sequence's score added at its last
    completion token; each token's advantage is its return-to-go (gamma 1), whitened over every valid token of
    the batch (every process's tokens with ``sum_across_processes``). With ``group_size`` the group's mean score
    is subtracted first (REINFORCE++-baseline), which removes the prompt's difficulty before the global whitening.
    Shapes: scores (B), mask and kl (B, T) -> advantages (B, T), zero outside the mask."""
    mask = mask.to(torch.float32)
    scores = scores.to(torch.float32)
    if group_size:
        if scores.numel() % group_size:
            raise RLHFInputError(f"{scores.numel()} scores do not split into groups of {group_size}")
        grouped = scores.view(-1, group_size)
        scores = (grouped - grouped.mean(-1, keepdim=True)).reshape(-1)
    rewards = -kl_coef * kl.to(torch.float32) * mask if kl is not None else torch.zeros_like(mask)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # each row's last completion token
    rewards[torch.arange(len(scores)), last] += scores * mask.any(-1)
    returns = (rewards * mask).flip(1).cumsum(1).flip(1)  # sum_{s >= t} r_s
    return whiten(returns, mask, sum_across_processes=sum_across_processes) * mask


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float = 0.5,
                         temperature: float = 1.0) -> torch.Tensor:
    """GKD's divergence per position (Agarwal et al. 2024, eq. 1), between the temperature-scaled token
    distributions of teacher T and student S: beta = 0 is the forward KL(T || S), beta = 1 the reverse KL(S || T),
    and in between the generalised Jensen-Shannon divergence beta KL(T || M) + (1 - beta) KL(S || M) with the
    mixture M = beta T + (1 - beta) S (TRL's GKDTrainer convention). Shapes: logits (..., V) -> (...)."""
    student = torch.log_softmax(student_logits.float() / temperature, -1)
    teacher = torch.log_softmax(teacher_logits.float() / temperature, -1)
    if beta == 0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1:
        return (student.exp() * (student - teacher)).sum(-1)
    mixture = torch.logsumexp(torch.stack([student + math.log(1 - beta), teacher + math.log(beta)]), 0)
    kl_teacher = (teacher.exp() * (teacher - mixture)).sum(-1)
    kl_student = (student.exp() * (student - mixture)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def rollout_importance_weights(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor, *,
                               cap: float = 2.0, mode: str = "token_truncate") -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights for rollouts sampled by an engine (vLLM) whose probabilities differ from the
    trainer's: the update should use samples of the trainer's policy pi, the engine drew them from mu.
    rho_t = pi(y_t) / mu(y_t), both of the distribution actually sampled from (after temperature and any
    top-k / top-p / min-p truncation, renormalised over the kept tokens), so a truncated sampler's kept mass
    cancels instead of scaling every ratio. Modes: ``token_truncate`` w_t = min(rho_t, C), truncated importance
    sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL"); ``token_mask``
    w_t = rho_t if 1/C <= rho_t <= C else 0, masked importance sampling; ``sequence_truncate`` /
    ``sequence_mask`` the same on the sequence ratio prod_t rho_t, shared by its tokens (Liu et al. 2025,
    "When speed kills stability"). Metrics: mean and max |log pi - log mu|, the k3 estimate of KL(mu || pi) on
    mu's samples (E[rho - 1 - log rho]), the mean weight and the share of tokens truncated or masked.
    Shapes: log-probs and mask (B, T) -> weights (B, T), zero outside the mask; metrics."""
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise RLHFInputError(f"unknown importance sampling mode '{mode}'; valid: "
                             f"{', '.join(IMPORTANCE_SAMPLING_MODES)}")
    # a token outside pi's support (log-prob -inf) gets rho ~ 0; positions outside the mask count as rho = 1
    token_log_rho = torch.where(mask.bool(), trainer_logps - engine_logps, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    mask = mask.to(trainer_logps.dtype)
    log_rho = token_log_rho
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(-1, keepdim=True).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).expand_as(mask)
    rho = torch.exp(log_rho)
    if mode.endswith("truncate"):
        weights, changed = rho.clamp(max=cap), rho > cap
    else:
        kept = (rho >= 1.0 / cap) & (rho <= cap)
        weights, changed = rho * kept, ~kept
    gap = token_log_rho.abs()
    metrics = {"logprob_abs_diff_mean": float(_masked_mean(gap, mask)), "logprob_abs_diff_max": float(gap.max()),
               "kl": float(_masked_mean(torch.exp(token_log_rho) - 1 - token_log_rho, mask)),
               "is_weight_mean": float(_masked_mean(weights, mask)),
               "is_changed_frac": float(_masked_mean(changed.to(mask.dtype), mask))}
    return (weights * mask).detach(), metrics


@dataclass
class PolicyLossInputs:
    """What every registered RL policy loss reads (POLICY_LOSSES). Shapes: ``logps``, ``old_logps``, ``log_ratio``
    and ``mask`` (B, T); ``advantages`` (B, 1) or (B, T), broadcast over the tokens.

    Args:
        logps: the policy's per-token log-probs, with gradient.
        old_logps: those of the policy that sampled (``logps`` detached when on-policy: ratio 1, with gradient).
        log_ratio: the log importance ratio per token, clamped (IMPORTANCE_LOG_RATIOS: GSPO's is the sequence's).
        advantages: per sequence (B, 1) or per token (B, T).
        mask: 1 on completion tokens, in the log-probs' dtype.
        epsilon_low, epsilon_high: the clip range of the ratio, [1 - epsilon_low, 1 + epsilon_high]."""

    logps: torch.Tensor
    old_logps: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2

    @property
    def ratio(self) -> torch.Tensor:
        return torch.exp(self.log_ratio)

    @property
    def clipped_ratio(self) -> torch.Tensor:
        return torch.clamp(self.ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)


def token_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi_t - log pi_old_t per token (PPO's ratio), clamped. Shapes: (B, T) each -> (B, T)."""
    return _clamped_log_ratio(logps, old_logps)


def sequence_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, eq. 7 in its GSPO-token form): every token's value is the length-normalised
    sequence log-ratio mean_t(logp - old), with the gradient through its own log-prob: sg[s_i] + logp_t -
    sg[logp_t]. Shapes: (B, T) each -> (B, T)."""
    token = _clamped_log_ratio(logps, old_logps)
    sequence = (token * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return sequence.detach() + logps - logps.detach()


# importance_sampling_level -> the log-ratio every policy loss clips (a test keeps IMPORTANCE_SAMPLING_LEVELS in step)
IMPORTANCE_LOG_RATIOS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": token_log_ratio, "sequence": sequence_log_ratio}


@dataclass(frozen=True)
class LossAggregation:
    """How a policy loss's per-token losses reduce, in one place for the loss and the trainer. ``reduce(per_token,
    mask, max_completion_length)`` is a micro-batch's loss; the trainer multiplies it by ``units(rows, tokens,
    max_completion_length)`` and BaseTrainer divides the step's sum by the step's units, so accumulation gives the
    loss of the whole step. ``per_micro_batch``: a mean within each micro-batch (BNPO), which the trainer rescales
    when it skips rows."""

    reduce: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    units: Callable[[int, int, int], int]
    per_micro_batch: bool = False


def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    return _masked_mean(per_token, mask)


def _fixed_length_sum(per_token: torch.Tensor, mask: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {  # one row per POLICY_LOSS_AGGREGATIONS name
    "sequence_mean": LossAggregation(_sequence_mean, lambda rows, tokens, length: rows),
    "micro_batch_token_mean": LossAggregation(_token_mean, lambda rows, tokens, length: 1, per_micro_batch=True),
    "step_token_mean": LossAggregation(_token_mean, lambda rows, tokens, length: tokens),
    "fixed_length_sum": LossAggregation(_fixed_length_sum, lambda rows, tokens, length: rows * length),
}


def clipped_surrogate_loss(inputs: PolicyLossInputs) -> torch.Tensor:
    """GRPO's per-token objective, Shao et al. 2024 eq. 3 (PPO's clipped surrogate): -min(rho A, clip(rho, 1 -
    eps_low, 1 + eps_high) A). Shapes: -> (B, T)."""
    advantage = inputs.advantages
    return -torch.min(inputs.ratio * advantage, inputs.clipped_ratio * advantage)


def cispo_loss(inputs: PolicyLossInputs) -> torch.Tensor:
    """CISPO (MiniMax-M1, 2025): every token keeps its gradient; the importance weight is clipped and detached
    instead: -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp. Shapes: -> (B, T)."""
    return -inputs.clipped_ratio.detach() * inputs.advantages * inputs.logps


# the built-in losses, in GRPO_LOSS_TYPES' order (a test keeps the two in step)
for _name, _aggregation in (("grpo", "sequence_mean"), ("bnpo", "micro_batch_token_mean"), ("dapo", "step_token_mean"),
                            ("dr_grpo", "fixed_length_sum")):
    register_policy_loss(_name, aggregation=_aggregation)(clipped_surrogate_loss)
register_policy_loss("cispo", aggregation="step_token_mean", token_level_only=True)(cispo_loss)


def grpo_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
              ref_per_token_logps: torch.Tensor | None, advantages: torch.Tensor, completion_mask: torch.Tensor, *,
              epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.04, loss_type: str = "grpo",
              max_completion_length: int | None = None, importance_weights: torch.Tensor | None = None,
              importance_sampling_level: str = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO objective, Shao et al. 2024 eq. 3, per token: -min(rho A, clip(rho, 1 -
    eps_low, 1 + eps_high) A) + beta * KL, with the k3 estimator KL = exp(ref - logp) - (ref - logp) - 1
    (Schulman 2020). ``loss_type`` names a registered PolicyLoss (POLICY_LOSSES: the per-token
    loss and its aggregation): ``grpo`` averages each sequence then the batch; ``bnpo`` / ``dapo`` (Yu et al. 2025
    eq. 8) average over all tokens; ``dr_grpo`` (Liu et al. 2025) divides the sum by B * max_completion_length;
    ``cispo`` below. ``old_per_token_logps`` None means on-policy (rho = 1 with gradient).
    ``importance_weights`` (rollout_importance_weights) scale each token's policy term: the rollout was
    sampled by another engine than the one whose log-probs the ratio uses.
    ``importance_sampling_level`` ``sequence`` is GSPO (Zheng et al. 2025, eq. 7 and its GSPO-token form):
    every token of a sequence gets the length-normalised sequence ratio exp(mean_t(logp - old)) as its value,
    with the gradient through its own log-prob, sg[s_i] * pi_t / sg[pi_t]; it is clipped like the token ratio.
    ``loss_type`` ``cispo`` (MiniMax-M1, 2025) keeps every token's gradient and clips the importance weight
    instead: -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp, aggregated as ``dapo`` (token mean).
    Advantages may be per token (B, T), as REINFORCE++'s are.
    Shapes: log-probs, mask and importance weights (B, T), advantages (B) or (B, T) -> scalar loss, metrics."""
    loss_spec = policy_loss(loss_type)
    if importance_sampling_level not in IMPORTANCE_LOG_RATIOS:
        raise RLHFInputError(f"unknown importance_sampling_level '{importance_sampling_level}'; valid: "
                             f"{', '.join(IMPORTANCE_LOG_RATIOS)}")
    mask = completion_mask.to(per_token_logps.dtype)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    inputs = PolicyLossInputs(per_token_logps, old,
                              IMPORTANCE_LOG_RATIOS[importance_sampling_level](per_token_logps, old, mask),
                              advantages[:, None] if advantages.dim() == 1 else advantages, mask,
                              epsilon_low, epsilon_high)
    per_token_loss = loss_spec.per_token(inputs)
    if importance_weights is not None:
        per_token_loss = per_token_loss * importance_weights
    metrics: dict[str, float] = {}
    if beta and ref_per_token_logps is not None:
        log_ratio = _clamped_log_ratio(ref_per_token_logps, per_token_logps)
        kl = torch.exp(log_ratio) - log_ratio - 1
        per_token_loss = per_token_loss + beta * kl
        metrics["kl"] = float(_masked_mean(kl.detach(), mask))
    loss = LOSS_AGGREGATIONS[loss_spec.aggregation].reduce(per_token_loss, mask,
                                                           max_completion_length or per_token_logps.shape[1])
    ratio, advantage = inputs.ratio, inputs.advantages
    low = ((ratio < 1 - epsilon_low) & (advantage < 0)).to(mask.dtype)
    high = ((ratio > 1 + epsilon_high) & (advantage > 0)).to(mask.dtype)
    metrics.update({"clip_ratio/low_mean": float(_masked_mean(low, mask)),
                    "clip_ratio/high_mean": float(_masked_mean(high, mask)),
                    "clip_ratio/region_mean": float(_masked_mean(low + high, mask))})
    return loss, metrics


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
                lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, Schulman et al. 2016 eq. 16: delta_t = r_t + gamma V_{t+1} -
    V_t, A_t = sum_l (gamma lam)^l delta_{t+l}; positions outside ``mask`` count as terminal.
    Returns (advantages, returns = advantages + values), both zero outside the mask.
    Shapes: rewards, values, mask (B, T) -> (B, T), (B, T)."""
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def ppo_policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                    clip_range: float = 0.2, importance_weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate, Schulman et al. 2017 eq. 7, per token: max(-A rho, -A clip(rho, 1 - c,
    1 + c)) averaged over the mask, each token scaled by ``importance_weights`` when a rollout engine
    sampled it (rollout_importance_weights). Metrics: clip fraction and approximate KL 0.5 (logp - old)^2.
    Shapes: (B, T) each -> scalar loss, metrics."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(_clamped_log_ratio(logps, old_logps))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    per_token = torch.max(unclipped, clipped)
    loss = _masked_mean(per_token * importance_weights if importance_weights is not None else per_token, mask)
    return loss, {"policy/clipfrac": float(_masked_mean((clipped > unclipped).to(mask.dtype), mask)),
                  "policy/approxkl": float(0.5 * _masked_mean((logps - old_logps).detach() ** 2, mask))}


def ppo_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                   clip_range_value: float = 0.2) -> torch.Tensor:
    """Clipped value loss (PPO2 / TRL): 0.5 * mean over the mask of max((V - R)^2, (V_clip - R)^2),
    V_clip = V_old + clip(V - V_old, -c, c). Shapes: (B, T) each -> scalar."""
    clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    return 0.5 * _masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask.to(values.dtype))


class AdaptiveKLController:
    """Ziegler et al. 2019 sec. 2.2: beta_{t+1} = beta_t (1 + K_beta e_t n / horizon) with the
    proportional error e_t = clip(KL_t / target - 1, -0.2, 0.2) and K_beta = 1."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon
        return self.value


class FixedKLController:
    """A constant KL coefficient (``update`` changes nothing)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


# ==== 8. Rewards ====
# A reward function maps (prompts, completions, answers) to one float per completion. Learned,
# HTTP and constitutional rewards join these rule-based ones with the online-RL stages.

RewardFn = Callable[[list[str], list[str], list[str | None]], torch.Tensor]


def exact_answer_reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> torch.Tensor:
    """1.0 when the number after the completion's last ``Answer:`` equals the known answer, else 0.0
    (prompts without an answer score 0)."""
    return torch.tensor([float(a is not None and extract_answer(c) == str(a).strip())
                         for c, a in zip(completions, answers, strict=True)])


def format_reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> torch.Tensor:
    """1.0 when the completion ends its reasoning with an ``Answer: <number>`` line (seed 002's format check)."""
    return torch.tensor([float(extract_answer(c) is not None) for c in completions])


def length_penalty(target_chars: int, scale: float = 1.0) -> RewardFn:
    """-scale * |len - target| / target: penalises completions longer or shorter than ``target_chars``."""
    if target_chars <= 0:
        raise RLHFInputError("length_penalty target_chars must be > 0")

    def reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> torch.Tensor:
        return torch.tensor([-scale * abs(len(c) - target_chars) / target_chars for c in completions])

    return reward


def no_reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> torch.Tensor:
    """Zero for every completion: the reward functions' part of a run whose signal comes from elsewhere (an agent
    program's returned reward)."""
    return torch.zeros(len(completions))


def _call_reward(function: RewardFn, prompts: list[str], completions: list[str], answers: list[str | None],
                 records: list[dict[str, Any]] | None) -> torch.Tensor:
    """Reward functions that declare ``wants_records`` also get the prompt records (system prompt and
    full conversation), which learned rewards need to render the chat template as in training."""
    if getattr(function, "wants_records", False):
        scores = function(prompts, completions, answers, records=records)
    else:
        scores = function(prompts, completions, answers)
    scores = torch.as_tensor(scores, dtype=torch.float32).flatten().cpu()
    if scores.numel() != len(completions):
        raise RLHFInputError(f"reward function {getattr(function, '__name__', function)!r} returned {scores.numel()} "
                             f"scores for {len(completions)} completions; return one float per completion")
    return scores


class CompositeReward:
    """A weighted sum of reward functions; ``last_components`` keeps each one's scores for logging."""

    wants_records = True

    def __init__(self, parts: list[tuple[str, RewardFn, float]]) -> None:
        if not parts:
            raise RLHFInputError("a composite reward needs at least one reward function")
        self.parts = parts
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None],
                 records: list[dict[str, Any]] | None = None) -> torch.Tensor:
        total = torch.zeros(len(completions))
        for name, function, weight in self.parts:
            scores = _call_reward(function, prompts, completions, answers, records)
            self.last_components[name] = scores
            total = total + weight * scores
        return total


def _prompt_records(prompts: list[str], records: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return records if records is not None else [{"system": "", "messages": [{"role": "user", "content": p}]}
                                                for p in prompts]


class LearnedReward:
    """A reward model (or ensemble) as a reward function: each (prompt, completion) is rendered with
    the chat template the reward model was trained with and scored at its last token. For an
    ensemble the reward is mean - ``uncertainty_penalty`` * std (pessimism where the members
    disagree, which is where a policy can exploit a reward model); ``last_uncertainty`` keeps the std."""

    wants_records = True

    def __init__(self, model: RewardModel | RewardEnsemble, *, template: str = "auto", uncertainty_penalty: float = 0.0,
                 batch_size: int = 32, cutoff_len: int | None = None, enable_thinking: bool | None = None) -> None:
        self.model = model if isinstance(model, RewardEnsemble) else RewardEnsemble([model])
        self.model.requires_grad_(False).eval()
        self.formatter = ChatFormatter(self.model.tokenizer, template, enable_thinking=enable_thinking)
        self.uncertainty_penalty, self.batch_size, self.cutoff_len = uncertainty_penalty, batch_size, cutoff_len
        self.last_uncertainty = torch.zeros(0)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, device: torch.device | str = "cpu",
                        **kwargs: Any) -> LearnedReward:
        directory = Path(directory)
        if not (directory / RewardModel.CONFIG_FILE).exists() and not (directory / RewardEnsemble.MANIFEST).exists():
            raise RLHFInputError(f"config field 'reward_model': {directory} holds no reward model (no "
                                 f"{RewardModel.CONFIG_FILE} or {RewardEnsemble.MANIFEST}); train one with the rm "
                                 "stage")
        return cls(RewardEnsemble.from_pretrained(directory, device=device, is_trainable=False), **kwargs)

    def encode(self, record: dict[str, Any], completion: str) -> list[int]:
        prompt, answer = self.formatter.prompt_and_completion(record, completion)
        ids = prompt + answer  # the conversation's own tokens, as the rm stage trained on them
        return ids[-self.cutoff_len:] if self.cutoff_len else ids

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None],
                 records: list[dict[str, Any]] | None = None) -> torch.Tensor:
        rows = [self.encode(r, c) for r, c in zip(_prompt_records(prompts, records), completions, strict=True)]
        device = next(self.model.parameters()).device
        means, stds = [], []
        for start in range(0, len(rows), self.batch_size):
            batch = _pad_rows(rows[start:start + self.batch_size], rows[start:start + self.batch_size],
                              self.model.tokenizer.pad_token_id)
            mean, std = self.model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
            means.append(mean.float().cpu())
            stds.append(std.float().cpu())
        self.last_uncertainty = torch.cat(stds)
        return torch.cat(means) - self.uncertainty_penalty * self.last_uncertainty


class ProcessReward:
    """A process reward model as a reward function: each completion's steps are scored and
    aggregated; the reward is the aggregated probability that every step is right, in [0, 1].
    With ``cutoff_len`` a long prompt and completion are cut as the prm stage cut its training pairs
    (the prompt's end and the completion's start kept); steps past the cut are not scored."""

    wants_records = True

    def __init__(self, model: ProcessRewardModel, *, template: str = "auto", batch_size: int = 32,
                 cutoff_len: int | None = None, enable_thinking: bool | None = None) -> None:
        self.model = model.requires_grad_(False).eval()
        self.formatter = ChatFormatter(model.tokenizer, template, enable_thinking=enable_thinking)
        self.batch_size, self.cutoff_len = batch_size, cutoff_len

    def encode(self, record: dict[str, Any], completion: str) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, completion ids, index of each scored step's last token), cut to cutoff_len."""
        prompt = self.formatter.prompt_ids(record)
        ids, ends = encode_steps(self.formatter, record, completion, self.model.step_delimiter)
        if self.cutoff_len:
            kept_prompt, (kept,), status = truncate_prompt_and_responses(prompt, [ids], self.cutoff_len)
            if status == "dropped":  # a cutoff too small for both: one completion token after the prompt's end
                kept_prompt, kept = prompt[-max(1, self.cutoff_len - 1):], ids[:1]
            prompt, ids = kept_prompt, kept
            ends = [end for end in ends if end < len(ids)] or [len(ids) - 1]  # cut inside step 1: score what is left
        return prompt, ids, ends

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None],
                 records: list[dict[str, Any]] | None = None) -> torch.Tensor:
        records = _prompt_records(prompts, records)
        collator = ProcessPreferenceCollator(self.model.tokenizer.pad_token_id)
        device = next(self.model.parameters()).device
        scores = []
        for start in range(0, len(completions), self.batch_size):
            items = []
            for record, completion in zip(records[start:start + self.batch_size],
                                          completions[start:start + self.batch_size]):
                prompt, ids, ends = self.encode(record, completion)
                items.append({"prompt_ids": prompt, "chosen_ids": ids, "rejected_ids": ids,
                              "chosen_steps": ends, "rejected_steps": ends, "chosen_labels": [-1.0] * len(ends),
                              "rejected_labels": [-1.0] * len(ends)})
            batch = {k: v.to(device) for k, v in collator(items).items()}
            rows = len(items)  # the collator doubles rows (chosen, rejected); both halves are the same completion
            log_p = self.model(batch["input_ids"][:rows], batch["attention_mask"][:rows],
                               batch["step_positions"][:rows], batch["step_mask"][:rows])
            scores.append(log_p.exp().float().cpu())
        return torch.cat(scores)


HTTP_ANSWER_LIMIT = 64 << 20  # bytes a reward or environment service may answer with


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error (an HTTPError with its 3xx code): urllib would follow it to another host with the
    request's Authorization header (and turn a POST into a GET), so a credential could reach a host it was not for."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def post_json(url: str, payload: bytes, *, timeout: float, api_key: str | None = None,
              limit: int = HTTP_ANSWER_LIMIT) -> Any:
    """POST JSON to a reward or environment service and read its JSON answer: no redirect followed, at most ``limit``
    bytes read (a larger answer is a ValueError), ``api_key`` (from the environment, never a config) as a bearer
    token."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=payload, headers=headers, method="POST")
    with urllib.request.build_opener(_NoRedirects).open(request, timeout=timeout) as response:
        data = response.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"the answer is larger than {limit} bytes")
    return json.loads(data.decode("utf-8"))


class RewardAPIError(RLHFInputError):
    """The reward service stayed down or answered something that is not one reward per response."""


class HTTPReward:
    """Rewards from an HTTP service: POST ``{"prompts": [...], "responses": [...], "answers": [...]}``
    as JSON, receive ``{"rewards": [float, ...]}``. Timeouts, connection errors, 429 and 5xx are
    retried with exponential backoff; the bearer token, if any, comes from ``RLHF_REWARD_API_KEY``
    (never from config files, never logged)."""

    def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5) -> None:
        if not url or not url.startswith(("http://", "https://")):
            raise RLHFInputError(f"config field 'reward_api_url' is {url!r}; give an http:// or https:// URL")
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def _request(self, payload: bytes) -> Any:
        return post_json(self.url, payload, timeout=self.timeout, api_key=os.environ.get("RLHF_REWARD_API_KEY"))

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None]) -> torch.Tensor:
        payload = json.dumps({"prompts": prompts, "responses": completions, "answers": answers}).encode("utf-8")
        last_error: Exception | None = None
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                body = self._request(payload)
            except urllib.error.HTTPError as err:
                if err.code != 429 and err.code < 500:  # the request itself is wrong: retrying cannot help
                    raise RewardAPIError(f"reward API {self.url} refused the request: HTTP {err.code} "
                                         f"{err.reason}") from None
                last_error = err
            except (OSError, TimeoutError, http.client.HTTPException) as err:  # URLError, refused connections,
                last_error = err  # timeouts (OSErrors) and a response cut short (IncompleteRead) are retried
            except ValueError as err:
                raise RewardAPIError(f"reward API {self.url} did not return JSON ({err})") from None
            else:
                return self._rewards(body, len(completions))
            logger.warning("reward API %s: attempt %d of %d failed (%s)", self.url, attempt + 1, self.retries,
                           getattr(last_error, "reason", last_error))
        raise RewardAPIError(f"reward API {self.url} did not answer after {self.retries} attempts (last error: "
                             f"{getattr(last_error, 'reason', last_error)}); start the service or raise "
                             f"reward_api_retries / reward_api_timeout")

    def _rewards(self, body: Any, expected: int) -> torch.Tensor:
        rewards = body.get("rewards") if isinstance(body, dict) else None
        if not isinstance(rewards, list) or len(rewards) != expected or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
            raise RewardAPIError(f"reward API {self.url} must answer {{\"rewards\": [{expected} numbers]}}; "
                                 f"got {str(body)[:200]}")
        return torch.tensor(rewards, dtype=torch.float32)


def _distinct_ratio(text: str, n: int = 3) -> float:
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


# Constitution checks: (argument) -> (prompt, completion) -> satisfaction in [0, 1]
PRINCIPLE_CHECKS: dict[str, Callable[[str | None], Callable[[str, str], float]]] = {
    "answer_line": lambda arg: lambda prompt, completion: float(extract_answer(completion) is not None),
    "max_chars": lambda arg: lambda prompt, completion: min(1.0, int(arg) / max(len(completion), 1)),
    "no_repetition": lambda arg: lambda prompt, completion: _distinct_ratio(completion),
    "regex": lambda arg: lambda prompt, completion: float(re.search(arg, completion) is not None),
}


FREE_TEXT_PRINCIPLES = ("regex", "critique")  # arguments that may contain '@'


@dataclass
class Principle:
    """One rule of a constitution: a ``check`` returning satisfaction in [0, 1] (a violation costs
    ``weight`` * (1 - satisfaction)), or a ``critique`` text that the reward model reads as a system
    prompt before scoring the response (adds ``weight`` * that score)."""

    name: str
    weight: float = 1.0
    check: Callable[[str, str], float] | None = None
    critique: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Principle:
        """``check[=arg][@weight]``, e.g. ``max_chars=200@0.5`` or ``critique=Be concise.@0.2``. Only a
        finite number after the last ``@`` is a weight; a ``regex`` or ``critique`` text may contain ``@``
        (``regex=\\w+@\\w+`` has weight 1), and one that ends in ``@<number>`` needs a weight after it."""
        body, _, weight = spec.rpartition("@")
        if not body or not weight:  # no '@', or a trailing one that belongs to the text
            body, weight = spec, ""
        try:
            weight_value = float(weight) if weight else 1.0
            if not math.isfinite(weight_value):
                raise ValueError
        except ValueError:
            if body.partition("=")[0] not in FREE_TEXT_PRINCIPLES:  # no free text the '@' could belong to
                raise RLHFInputError(f"config field 'constitution': weight in {spec!r} is not a finite "
                                     "number") from None
            body, weight_value = spec, 1.0  # the '@' is part of the pattern or the critique
        name, _, arg = body.partition("=")
        if name == "critique":
            if not arg:
                raise RLHFInputError("config field 'constitution': critique needs its text, e.g. critique=Be "
                                     "concise.@0.5")
            return cls(f"critique:{arg[:24]}", weight_value, critique=arg)
        if name not in PRINCIPLE_CHECKS:
            raise RLHFInputError(f"config field 'constitution': unknown check '{name}' in {spec!r}; valid: "
                                 f"{', '.join(PRINCIPLE_CHECKS)}, critique")
        if name in ("max_chars", "regex") and not arg:
            raise RLHFInputError(f"config field 'constitution': {name} needs an argument, e.g. {name}=...")
        if name == "max_chars" and not arg.isdigit():
            raise RLHFInputError(f"config field 'constitution': max_chars={arg} is not a whole number")
        if name == "regex":
            try:
                re.compile(arg)
            except re.error as err:
                raise RLHFInputError(f"config field 'constitution': regex {arg!r} does not compile ({err})") from None
        return cls(name if not arg else f"{name}={arg}", weight_value, check=PRINCIPLE_CHECKS[name](arg or None))


class ConstitutionalRewardWrapper:
    """A base reward shaped by a constitution: reward = base + sum over checks of weight *
    (satisfaction - 1) + sum over critiques of weight * critic score (the critic, a reward model,
    reads the principle as the system prompt). Each principle's scores go to ``last_components``."""

    wants_records = True

    def __init__(self, base: RewardFn | None, principles: list[Principle], critic: LearnedReward | None = None) -> None:
        if any(p.critique for p in principles) and critic is None:
            raise RLHFInputError("config field 'constitution': critique principles need a reward model (set "
                                 "reward_model)")
        self.base, self.principles, self.critic = base, principles, critic
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None],
                 records: list[dict[str, Any]] | None = None) -> torch.Tensor:
        total = (_call_reward(self.base, prompts, completions, answers, records) if self.base is not None
                 else torch.zeros(len(completions)))
        self.last_components = dict(getattr(self.base, "last_components", {}))
        for principle in self.principles:
            if principle.check is not None:
                scores = torch.tensor([principle.check(p, c) for p, c in zip(prompts, completions, strict=True)])
                total = total + principle.weight * (scores - 1)
            else:
                critiqued = [{**r, "system": principle.critique} for r in _prompt_records(prompts, records)]
                scores = self.critic(prompts, completions, answers, records=critiqued)
                total = total + principle.weight * scores
            self.last_components[f"principle/{principle.name}"] = scores
        return total


def _import_callable(spec: str, field_name: str, failure: str, advice: str) -> Callable:
    """The callable a config field names as ``module:function``, or one line naming the field and the fix."""

    module_name, _, attribute = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise RLHFInputError(f"config field '{field_name}': {failure} ({error}); {advice}") from None
    if not callable(found):
        raise RLHFInputError(f"config field '{field_name}': {spec} is not callable")
    return found


class RewardFunctionFactory:
    """Builds the reward of an online-RL stage from its config: the named ``reward_funcs`` with
    ``reward_weights`` as one :class:`CompositeReward`, wrapped in a constitution if one is given.
    Names: exact_answer, format, length, reward_model (learned: full, lora adapter, or ensemble;
    api when reward_model_type=api), api, or ``module:function`` for your own function."""

    RULES: dict[str, RewardFn] = {"exact_answer": exact_answer_reward, "format": format_reward}

    def __init__(self, config: BaseConfig, device: torch.device | str = "cpu") -> None:
        self.config, self.device = config, device
        self._learned: LearnedReward | None = None

    def build(self) -> RewardFn:
        names = self.config.reward_names()
        if not names and getattr(self.config, "environment", None) == "agent":
            return no_reward  # the agents' own rewards are the signal
        weights = self.config.reward_weights or [1.0] * len(names)
        reward: RewardFn = CompositeReward([(name, self.build_one(name), float(w)) for name, w in zip(names, weights)])
        if self.config.constitution:
            principles = [Principle.parse(spec) for spec in self.config.constitution]
            critic = self.learned() if any(p.critique for p in principles) else None
            reward = ConstitutionalRewardWrapper(reward, principles, critic)
        return reward

    def build_one(self, name: str) -> RewardFn:
        config = self.config
        if name in self.RULES:
            return self.RULES[name]
        if name == "length":
            return length_penalty(config.length_target_chars)
        if name == "api" or (name == "reward_model" and config.reward_model_type == "api"):
            if not config.reward_api_url:
                raise RLHFInputError(f"config field 'reward_api_url' is not set but reward '{name}' calls the API")
            return HTTPReward(config.reward_api_url, timeout=config.reward_api_timeout,
                              retries=config.reward_api_retries)
        if name == "reward_model":
            return self.learned()
        if name == "process_reward_model":
            if not config.process_reward_model:
                raise RLHFInputError("config field 'process_reward_model' is not set; give the prm stage's output "
                                     "directory")
            model = ProcessRewardModel.from_pretrained(config.process_reward_model, device=self.device,
                                                       is_trainable=False)
            return ProcessReward(model, template=config.template, batch_size=config.per_device_eval_batch_size,
                                 cutoff_len=config.cutoff_len, enable_thinking=config.enable_thinking)
        if ":" in name:
            return self._import(name)
        raise RLHFInputError(f"config field 'reward_funcs': unknown reward '{name}'; valid: "
                             f"{', '.join([*self.RULES, 'length', 'reward_model', 'process_reward_model', 'api'])}, "
                             f"or module:function")

    def learned(self) -> LearnedReward:
        if self._learned is None:
            if not self.config.reward_model:
                raise RLHFInputError("config field 'reward_model' is not set; give the rm stage's output directory")
            self._learned = LearnedReward.from_pretrained(
                self.config.reward_model, device=self.device, template=self.config.template,
                uncertainty_penalty=self.config.reward_uncertainty_penalty,
                batch_size=self.config.per_device_eval_batch_size, cutoff_len=self.config.cutoff_len,
                enable_thinking=self.config.enable_thinking)
        return self._learned

    @staticmethod
    def _import(spec: str) -> RewardFn:
        return _import_callable(spec, "reward_funcs", f"cannot import {spec}",
                                "use module:function with the module on PYTHONPATH")


class RunningRewardNormalizer:
    """Running mean/std of every reward seen (Chan et al.'s parallel update); ``normalize`` returns
    (r - mean) / (std + eps), optionally clipped to [-clip, clip]. Its state is JSON for checkpoints."""

    def __init__(self, clip: float | None = None, eps: float = 1e-8) -> None:
        self.count, self.mean, self.m2, self.clip, self.eps = 0, 0.0, 0.0, clip, eps

    def update(self, rewards: torch.Tensor) -> None:
        values = rewards.detach().double().flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean, batch_m2 = float(values.mean()), float(((values - values.mean()) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta ** 2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def normalize(self, rewards: torch.Tensor) -> torch.Tensor:
        out = (rewards - self.mean) / (self.std + self.eps)
        return out.clamp(-self.clip, self.clip) if self.clip else out

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def process_rewards(rewards: torch.Tensor, *, normalizer: RunningRewardNormalizer | None = None,
                    clip: float | None = None) -> torch.Tensor:
    """Optional reward shaping before advantages: running mean/std normalisation (the normaliser
    first sees this batch), then clipping to [-clip, clip]."""
    if normalizer is not None:
        normalizer.update(rewards)
        rewards = normalizer.normalize(rewards)
    return rewards.clamp(-clip, clip) if clip else rewards


# ---- Environments: multi-turn tool use ----
# An episode: reset(record) may add a first observation after the prompt; then each turn the policy generates,
# step(turn text) answers with an observation (a tool's output), a reward and whether the episode is over. The
# observation's tokens enter the context but are never trained on (masked from every loss and the KL).


class Environment(typing.Protocol):
    """What an online-RL rollout talks to. ``reset`` returns text to append after the prompt (or None);
    ``step`` receives the text of the policy's last turn and returns (observation or None, reward, done)."""

    def reset(self, record: dict[str, Any]) -> str | None: ...

    def step(self, completion: str) -> tuple[str | None, float, bool]: ...


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_call(text: str, tool_format: str = "tag", tags: tuple[str, str] = ("<calc>", "</calc>"),
                    default_tool: str = "calculator") -> ToolCall | None:
    """The last tool call in a turn's text, or None. ``tag``: the text between ``tags`` is the argument
    (``expression``) of ``default_tool``, e.g. ``<calc>12*7</calc>``. ``chat_template``: the JSON form of the
    Hermes / Qwen2.5 / Qwen3 templates, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, or a bare
    ``{"name": ..., "parameters": {...}}`` object (Llama 3.1's JSON tool calls)."""
    if tool_format == "tag":
        opening, closing = tags
        end = text.rfind(closing)
        start = text.rfind(opening, 0, end) if end >= 0 else -1
        if start < 0:
            return None
        return ToolCall(default_tool, {"expression": text[start + len(opening):end].strip()})
    found = re.findall(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", text, flags=re.S)
    candidates = found or re.findall(r"(\{\s*\"name\".*\})\s*$", text.strip(), flags=re.S)
    for raw in reversed(candidates):
        try:
            call = json.loads(raw)
        except ValueError:
            continue
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(arguments, dict):
            return ToolCall(call["name"], arguments)
    return None


_CALCULATOR_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                         ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Arithmetic on numbers with + - * / // % ** and parentheses, evaluated from the syntax tree (no names, calls
    or attributes, so nothing but arithmetic can run); an integral result is written without a decimal point.
    A bad expression returns an ``error: ...`` text for the policy to read, as a real tool would."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _CALCULATOR_OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or _bits(left) * abs(right) > CALCULATOR_BITS):
                raise ValueError("result too large")  # checked before the power is computed
            return _bounded(_CALCULATOR_OPERATORS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _CALCULATOR_OPERATORS:
            return _CALCULATOR_OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {type(node).__name__}")

    try:
        with warnings.catch_warnings():  # a policy's "2x" is an error answered to it, not a warning to the user
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
        result = _bounded(value(tree.body))
        if isinstance(result, float) and result.is_integer():
            result = int(result)
        return str(round(result, 6) if isinstance(result, float) else result)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError) as error:
        return f"error: {error}"


CALCULATOR_BITS = 4096  # the largest operand or result (in bits) the calculator computes: a tool call stays cheap


def _bits(number: float) -> int:
    return int(abs(number)).bit_length() if math.isfinite(number) else CALCULATOR_BITS + 1


def _bounded(number: float) -> float:
    """``number``, or ValueError when it has more than CALCULATOR_BITS bits (a policy's ((10**64)**64)**64 would
    otherwise hold the interpreter, and so the watchdog, for hours)."""
    if _bits(number) > CALCULATOR_BITS:
        raise ValueError("result too large")
    return number


class ToolEnvironment:
    """Tools called from the policy's turns: each turn with a tool call gets the tool's output as the observation
    (``tag`` format: inside ``result_tags``, the turn continues; ``chat_template``: rendered as a ``tool`` message by
    the trainer); a turn without a call ends the episode. Rewards come from the reward functions on the whole
    completion; a call of an unknown tool gets an ``error:`` observation."""

    def __init__(self, tools: dict[str, Callable[..., str]], *, tool_format: str = "tag",
                 tags: tuple[str, str] = ("<calc>", "</calc>"), result_tags: tuple[str, str] = ("<result>", "</result>")
                 ) -> None:
        self.tools, self.tool_format, self.tags, self.result_tags = tools, tool_format, tags, result_tags
        self.calls = 0

    def reset(self, record: dict[str, Any]) -> str | None:
        self.calls = 0
        return None

    def step(self, completion: str) -> tuple[str | None, float, bool]:
        call = parse_tool_call(completion, self.tool_format, self.tags, default_tool=next(iter(self.tools)))
        if call is None:
            return None, 0.0, True
        self.calls += 1
        tool = self.tools.get(call.name)
        output = tool(**call.arguments) if tool is not None else f"error: no tool named {call.name!r}"
        if self.tool_format == "tag":
            output = f"{self.result_tags[0]}{output}{self.result_tags[1]}"
        return output, 0.0, False


class CalculatorEnvironment(ToolEnvironment):
    """The demo's tool: ``calculate`` as ``calculator(expression=...)``."""

    def __init__(self, **options: Any) -> None:
        super().__init__({"calculator": lambda expression="", **_: calculate(str(expression))}, **options)


class EnvironmentFault(RuntimeError):
    """An environment that failed to answer (a service down after its retries): the episode is dropped, the run
    goes on (a refusal that a request itself caused is an RLHFInputError instead)."""


class HTTPEnvironment:
    """An environment served over HTTP (like the API reward: timeouts, retries with backoff, one clear error).
    POST ``{url}/reset`` ``{"record": ...}`` -> ``{"episode_id", "observation"}``; POST ``{url}/step``
    ``{"episode_id", "completion"}`` -> ``{"observation", "reward", "done"}``. A bearer token, if the service needs
    one, comes from ``RLHF_ENVIRONMENT_API_KEY`` (never a config file); no redirect is followed and an answer is at
    most HTTP_ANSWER_LIMIT bytes."""

    def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5) -> None:
        if not url or not url.startswith(("http://", "https://")):
            raise RLHFInputError(f"config field 'environment_url' is {url!r}; give an http:// or https:// URL")
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff
        self.episode: Any = None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload, last = json.dumps(body).encode("utf-8"), None
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                answer = post_json(self.url + path, payload, timeout=self.timeout,
                                   api_key=os.environ.get("RLHF_ENVIRONMENT_API_KEY"))
            except urllib.error.HTTPError as error:
                if error.code != 429 and error.code < 500:
                    raise RLHFInputError(f"environment {self.url}{path} refused the request: HTTP {error.code} "
                                         f"{error.reason}") from None
                last = error
            except (OSError, TimeoutError, http.client.HTTPException, ValueError) as error:
                last = error
            else:
                if not isinstance(answer, dict):
                    raise RLHFInputError(f"environment {self.url}{path} must answer a JSON object; got "
                                         f"{str(answer)[:200]}")
                return answer
        raise EnvironmentFault(f"environment {self.url} did not answer {path} after {self.retries} attempts (last "
                               f"error: {getattr(last, 'reason', last)}); start it or raise environment_retries / "
                               f"environment_timeout")

    def reset(self, record: dict[str, Any]) -> str | None:
        answer = self._post("/reset", {"record": {k: v for k, v in record.items() if k != "prompt_ids"}})
        self.episode = answer.get("episode_id")
        return answer.get("observation")

    def step(self, completion: str) -> tuple[str | None, float, bool]:
        answer = self._post("/step", {"episode_id": self.episode, "completion": completion})
        reward = answer.get("reward", 0.0)
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            raise RLHFInputError(f"environment {self.url}/step: 'reward' must be a number, got {reward!r}")
        return answer.get("observation"), float(reward), bool(answer.get("done", False))


# ---- Agent programs: an OpenAI-compatible endpoint for the policy (environment: agent) ----
# A user's agent, written against the OpenAI API, runs unchanged: ``agent(client, record) -> reward`` gets an
# ``openai.OpenAI`` client whose base_url is this episode's address on the endpoint; every chat or completion request
# it makes is sampled by the run's rollout engine, batched with the other episodes' requests, and recorded (prompt
# ids, sampled ids, log-probs) under the episode, which becomes a trajectory with the agent's reward.


@dataclass
class AgentCall:
    """One request of an agent: its prompt's token ids and budget in, the sampled ids and log-probs out."""

    episode: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    prompt_text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    versions: list[int | None] = field(default_factory=list)  # per sampled token: the weights that sampled it


class AgentEndpoint:
    """``/episodes/<id>/v1/chat/completions``, ``/episodes/<id>/v1/completions`` and ``/episodes/<id>/v1/models`` on
    127.0.0.1 (AReaL's way: each episode's client gets its own base_url), each episode's routes open to its own key
    only (``key_for(episode)``: its client's ``api_key``, None once it is not running), on a BoundedJSONServer (no
    request can hold or crash it). A request becomes an AgentCall in ``pending``, which the trainer's main thread
    samples (batched) and answers; ``prepare(episode, body, kind)`` turns a request's body into (prompt text, prompt
    ids, budget, stop strings) or raises ValueError, which the agent receives as an OpenAI error (HTTP 400). Request
    threads wait for their answer at most ``timeout`` seconds."""

    def __init__(self, prepare: Callable[[int, dict[str, Any], str], tuple[str, list[int], int, tuple[str, ...]]],
                 answer: Callable[[AgentCall, dict[str, Any], str], dict[str, Any]],
                 key_for: Callable[[int], str | None], *, port: int = 0, timeout: float = 1800.0,
                 idle_seconds: float = HTTP_IDLE_SECONDS) -> None:
        self.pending: list[AgentCall] = []
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        self.prepare, self.answer, self.key_for, self.timeout = prepare, answer, key_for, timeout
        self.http = BoundedJSONServer(self.route, "127.0.0.1", port, authorize=self.authorize,
                                      error_body=self.error_body, idle_seconds=idle_seconds, name="agent endpoint")
        self.port = self.http.port
        self.http.serve_in_thread("rlhf-agent-endpoint")

    @staticmethod
    def error_body(status: int, message: str) -> dict[str, Any]:
        """OpenAI's error form, so an agent's client raises its own error classes."""
        kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
        return {"error": {"message": message, "type": kind, "code": status}}

    @staticmethod
    def _parse(path: str) -> tuple[int, str]:
        match = re.fullmatch(r"/episodes/(\d{1,12})/v1/(models|chat/completions|completions)/?", path)
        if not match:
            raise HTTPRefusal(404, f"no such path: {path[:200]}; use this episode's base_url")
        return int(match.group(1)), match.group(2)

    def authorize(self, method: str, path: str, headers: Any) -> None:
        """Only the client of a running episode, holding that episode's key, reaches its routes."""
        episode, _ = self._parse(path)
        key = self.key_for(episode)
        if key is None:
            raise HTTPRefusal(401, f"episode {episode} is not running")
        require_bearer(headers, key, f"episode {episode}")

    def route(self, method: str, path: str, headers: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A request's status and answer (a request thread, once ``authorize`` let it in): a completion request
        waits for the main thread to sample it."""
        episode, what = self._parse(path)
        if what == "models" or method != "POST":
            if what != "models" or method != "GET":
                raise HTTPRefusal(404, f"no endpoint {method} {path[:200]}")
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "rlhf"}]}
        kind = "chat" if what == "chat/completions" else "completion"
        if body.get("stream"):
            raise ValueError("stream: true is not served; ask for the whole answer")
        try:
            text, prompt_ids, budget, stop = self.prepare(episode, body, kind)
        except ValueError as error:  # the agent's mistake, in its own words
            raise HTTPRefusal(400, str(error)) from None
        call = AgentCall(episode, prompt_ids, budget, stop, text)
        with self.arrived:
            self.pending.append(call)
            self.arrived.notify_all()
        if not call.done.wait(self.timeout):
            raise HTTPRefusal(504, f"not sampled within {self.timeout:g} s")
        if call.error:
            raise HTTPRefusal(400, call.error)
        return 200, self.answer(call, body, kind)

    def base_url(self, episode: int) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def take(self, running: Callable[[], int], linger: float = 0.0, poll: float = 0.01,
             episodes: range | None = None) -> list[AgentCall]:
        """The pending calls (of ``episodes``: one rollout's, while others run too), in episode order, once every
        running episode has one in (``running()`` counts the episodes still playing), or, with ``linger`` > 0, that
        many seconds after the first arrived (an episode busy with its tools does not hold the others up); an empty
        list once no episode runs. Waiting for every episode makes the batches, and so the samples, the same in
        every run."""
        first = None
        with self.arrived:
            while True:
                left = running()
                mine = [call for call in self.pending if episodes is None or call.episode in episodes]
                if mine and first is None:
                    first = time.monotonic()
                if mine and (len(mine) >= left or (linger and time.monotonic() - first >= linger)) or not left:
                    taken = {id(call) for call in mine}
                    self.pending = [call for call in self.pending if id(call) not in taken]
                    return sorted(mine, key=lambda call: call.episode)
                self.arrived.wait(poll)

    def close(self) -> None:
        self.http.close()


def openai_answer(call: AgentCall, body: dict[str, Any], kind: str, tokenizer: Any) -> dict[str, Any]:
    """The OpenAI-format answer to a sampled request (AgentEndpoint's ``answer``; a request thread): a chat completion
    or a text completion. With ``tools`` in a chat request, a JSON tool call in the answer (the Hermes / Qwen form) is
    returned as ``tool_calls``, as vLLM's tool parser does."""
    text = tokenizer.decode(call.token_ids, skip_special_tokens=True)
    ends = sorted((text.find(stop), stop) for stop in call.stop if stop and stop in text)
    if ends:  # OpenAI's (and vLLM's) answer leaves out the stop string it ended at; the trajectory keeps it
        text = text[:ends[0][0]]
    # vLLM's extension of the answer: which stop string (or stop token id) ended it, None at the length limit
    stop_reason = ends[0][1] if ends else (call.token_ids[-1] if call.token_ids and call.finish_reason == "stop"
                                            else None)
    usage = {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.token_ids),
             "total_tokens": len(call.prompt_ids) + len(call.token_ids)}
    base = {"id": f"rlhf-{call.episode}-{uuid.uuid4().hex[:8]}", "created": int(time.time()),
            "model": str(body.get("model") or "policy"), "usage": usage}
    logprobs = None
    if body.get("logprobs"):
        logprobs = {"content": [{"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(call.token_ids, call.logprobs)]}
    if kind != "chat":
        return {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": call.finish_reason, "logprobs": None,
                             "stop_reason": stop_reason}]}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = call.finish_reason
    tool = parse_tool_call(text, "chat_template") if body.get("tools") else None
    if tool is not None:
        message["content"] = text[:text.find("<tool_call>")].strip() if "<tool_call>" in text else None
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                  "function": {"name": tool.name, "arguments": json.dumps(tool.arguments)}}]
        finish = "tool_calls"
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs,
                         "stop_reason": stop_reason}]}


def concatenated_trajectory(calls: list[AgentCall]) -> tuple[list[int], list[int], list[float], list[bool]]:
    """One episode's calls as one trajectory: the first call's prompt, then every sampled token (trained) and the
    tokens the agent added between calls (tool results, user turns: observed, never trained). Each call's prompt
    ids must extend the last call's prompt and sampled ids, which the endpoint ensures whenever the request's text
    extends the last one's (``AgentProgramSource.prepare``). Returns (prompt ids, completion ids, their log-probs (0
    where observed), observed mask); ValueError naming the request that does not extend the last."""
    context, tokens, logps, observed = list(calls[0].prompt_ids), [], [], []
    for number, call in enumerate(calls, 1):
        if list(call.prompt_ids[:len(context)]) != context:
            raise ValueError(f"request {number} does not begin with request {number - 1}'s prompt and answer (the "
                             f"chat template re-renders earlier turns differently, or the agent rewrote them), so "
                             f"the episode is not one trajectory")
        added = list(call.prompt_ids[len(context):])
        tokens += added + list(call.token_ids)
        logps += [0.0] * len(added) + list(call.logprobs)
        observed += [True] * len(added) + [False] * len(call.token_ids)
        context = list(call.prompt_ids) + list(call.token_ids)
    return list(calls[0].prompt_ids), tokens, logps, observed


# ---- Faults in rollouts: bounded retries, dropped episodes, a watchdog for what hangs ----


class CallTimedOut(TimeoutError):
    """An environment call that did not return within its time limit (its thread is left to finish on its own)."""


def call_with_timeout(function: Callable[..., Any], *args: Any, timeout: float | None) -> Any:
    """``function(*args)``, or CallTimedOut after ``timeout`` seconds (None: no limit). The call runs in a daemon
    thread, since Python cannot stop a call it is waiting on; a timed-out call's thread ends when the call does."""
    if not timeout:
        return function(*args)
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = function(*args)
        except BaseException as error:  # handed to the caller
            box["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="rlhf-rollout-call").start()
    if not done.wait(timeout):
        raise CallTimedOut(f"no answer in {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def retried(function: Callable[[], Any], attempts: int) -> Any:
    """``function()``, tried up to ``attempts`` times while it raises (a user mistake, RLHFInputError, is not
    retried); the last error propagates."""
    for attempt in range(attempts):
        try:
            return function()
        except RLHFInputError:
            raise
        except Exception:
            if attempt + 1 == attempts:
                raise
    raise AssertionError("attempts must be >= 1")


def guarded_call(function: Callable[[], Any], attempts: int,
                 timeout: float | None = None) -> tuple[Any, Exception | None]:
    """Retry, then drop: ``function()`` tried up to ``attempts`` times (each timed out after ``timeout`` seconds,
    CallTimedOut), giving (its value, None), or (None, the last error) once every attempt failed, for the caller to
    drop what it was for (an episode, a completion's reward). A user mistake (RLHFInputError) and a stop
    (RolloutHung, an interrupt) propagate."""
    try:
        return retried(lambda: call_with_timeout(function, timeout=timeout), attempts), None
    except RLHFInputError:
        raise
    except Exception as error:  # noqa: BLE001 (a user's environment, agent or reward: any error is a fault of its call)
        return None, error


class RolloutHung(BaseException):
    """Raised in the main thread when a rollout made no progress for ``rollout_timeout`` seconds. A BaseException, so
    the retry loops around environment and reward calls never take it for a fault of theirs."""


class RolloutWatchdog:
    """Stops a rollout that makes no progress: ``with watchdog:`` arms a real-time timer (SIGALRM) for ``timeout``
    seconds, each ``progress(what)`` (a turn sampled, an environment or reward call begun or answered) re-arms it and
    names what runs now, and a timer that runs out raises RolloutHung naming it. A signal interrupts a blocked socket
    read or sleep, which a flag checked between calls could not. Only in the main thread, where Python runs signal
    handlers, and where the platform has SIGALRM; a timeout of 0 turns it off."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.what, self.armed, self.previous = timeout, "the rollout", False, None

    def __enter__(self) -> RolloutWatchdog:
        self.armed = (self.timeout > 0 and hasattr(signal, "SIGALRM")
                      and threading.current_thread() is threading.main_thread())
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.timeout)
        return self

    def progress(self, what: str) -> None:
        self.what = what
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, self.timeout)

    def _fire(self, signum: int, frame: Any) -> None:
        raise RolloutHung(f"{self.what} made no progress for {self.timeout:g} s")

    def __exit__(self, *exc: Any) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
            self.armed = False


def failed_groups(failed: Sequence[bool], group: int) -> list[bool]:
    """Per completion: whether any completion of its group (``group`` consecutive ones) failed."""
    return [any(failed[start:start + group]) for start in range(0, len(failed), group) for _ in range(group)][
        :len(failed)]


def environment_factory(config: Any) -> Callable[[], Environment]:
    """A maker of fresh environments (one per episode) from ``config.environment``: calculator, http, or
    module:function returning an Environment."""
    name = config.environment
    options = {"tool_format": config.tool_format, "tags": tuple(config.tool_tags),
               "result_tags": tuple(config.tool_result_tags)}
    if name == "calculator":
        return lambda: CalculatorEnvironment(**options)
    if name == "http":
        return lambda: HTTPEnvironment(config.environment_url, timeout=config.environment_timeout,
                                       retries=config.environment_retries)
    return _import_callable(name, "environment", f"cannot load {name!r}", "give calculator, http or module:function")


# ==== 9. Rollouts ====
# Where an online stage's samples come from, in the order data moves: prompts (PromptStream) -> a rollout scheduler
# (sync, or sampling ahead of training) -> an episode source (one turn, a tool environment's turns, an agent program's
# requests) -> a rollout engine (ours, a low-precision copy, vLLM in this process or on servers) -> scores
# (RolloutScorer) -> rows (rollout_rows). Nothing here knows the trainer: each part takes what it needs as arguments
# (prime-rl's "components don't reference the orchestrator"), and what a rollout measured travels on its Episodes
# and Rollout records. A new episode source, scheduler or engine is one class here and one registry row.


# ---- The records: Rollout (rows to train on), Episodes (what a source sampled) ----


@dataclass
class Rollout:
    """One generation round of online RL, ready to train on: prompt + completion rows (right-padded,
    labels IGNORE_INDEX on prompts) and what the loss compares against. Shapes: input_ids,
    attention_mask, labels (N, T); per-token fields (N, T-1) aligned with the shifted labels;
    GRPO's and RLOO's advantages are per sequence (N), REINFORCE++'s and PPO's per token. ``metrics``: what making
    it measured (logged once, with its first optimizer step); ``skip_reason``: why every step trained on it skips its
    update (non-finite rewards), '' when none."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None  # (N) prompt tokens at the start of each row
    importance_weights: torch.Tensor | None = None  # (N, T-1) engine/trainer mismatch correction (use_vllm)
    pair_weights: torch.Tensor | None = None  # (N) online DPO: 1 for a ranked pair's rows, 0 for a tie's
    ref_summed: torch.Tensor | None = None  # (N) online DPO: each row's summed reference log-prob
    skip_reason: str = ""
    images: list[list[str]] | None = None  # (N) each row's image paths (a vision-language policy's image prompts)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.labels[:, 1:] != IGNORE_INDEX

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def micro_batches(self, size: int, order: torch.Tensor | None = None, vision: VisionInputs | None = None,
                      chunks: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Consecutive micro-batches of ``size`` rows, in ``order`` (a permutation) if given; ``chunks``: exactly
        that many micro-batches of near-equal size instead (a rollout whose row count is not the planned one, e.g.
        an agent's calls as rows, still fills one optimizer step); with ``vision``, each also holds the pixel
        inputs of its rows' images."""
        fields = self.tensors()
        rows = order if order is not None else torch.arange(self.input_ids.shape[0])
        parts = rows.tensor_split(chunks) if chunks else [rows[i:i + size] for i in range(0, len(rows), size)]
        batches = [{k: v[part] for k, v in fields.items()} for part in parts]
        if vision is not None and self.images:
            for part, batch in zip(parts, batches):
                batch.update(vision.batch([self.images[int(r)] for r in part], batch["input_ids"]))
        return batches


SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels")


def _trim_columns(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop padding columns every row of a micro-batch shares (rows were padded to the whole rollout)."""
    width = int(batch["attention_mask"].sum(-1).max())
    return {k: v if v.dim() < 2 or k in ("pixel_values", "image_grid_thw") else v[:, :width]
            if k in (*SEQUENCE_KEYS, "mm_token_type_ids") else v[:, :width - 1] for k, v in batch.items()}


@dataclass
class Episodes:
    """What an episode source sampled for a rollout's prompts, one entry per completion (prompt-major: the n episodes
    of prompt i are entries i*n .. i*n+n-1), as the scorer and the trainer read it (SkyRL's GeneratorOutput, verl's
    AgentLoopOutput).

    ``token_ids``: each completion (an environment's or an agent's added tokens included); ``logprobs``: the engine's
    log-prob of each of its tokens (0 where observed); ``finish_reasons``: stop or length; ``records``: the record each
    completion answers (an agent's: with the prompt ids its first request sent); ``observation_mask``: per token, True
    where an environment or agent wrote it (never trained on), None for single turns; ``environment_rewards``: each
    episode's summed environment (agent) reward, None without one; ``failed``: episodes whose environment or agent
    failed after its retries; ``calls``: an agent's requests per episode, (prompt ids, token ids, log-probs, finish
    reason) each, for agent_trajectory per_call; ``policy_version``: the optimizer step of the weights that sampled
    them (an engine holding a copy; the oldest, when several did; None: the policy itself); ``metrics``: what sampling
    them measured; ``token_versions``: per token, the optimizer step of the weights that sampled it (None for a token
    an environment or agent wrote), where a server updated its weights while they were sampled."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    records: list[dict[str, Any]]
    observation_mask: list[list[bool]] | None = None
    environment_rewards: torch.Tensor | None = None
    failed: list[bool] = field(default_factory=list)
    calls: list[list[tuple]] | None = None
    policy_version: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    token_versions: list[list[int | None]] | None = None  # per token, the step of the weights that sampled it

    def __post_init__(self) -> None:
        if not self.failed:
            self.failed = [False] * len(self.token_ids)

    def select(self, rows: Sequence[int]) -> Episodes:
        """These completions, in this order (metrics kept)."""
        def pick(values: Any) -> Any:
            if values is None:
                return None
            return values[list(rows)] if isinstance(values, torch.Tensor) else [values[i] for i in rows]

        return Episodes(pick(self.token_ids), pick(self.logprobs), pick(self.finish_reasons), pick(self.records),
                        pick(self.observation_mask), pick(self.environment_rewards), pick(self.failed),
                        pick(self.calls), self.policy_version, dict(self.metrics), pick(self.token_versions))


def completion_metrics(episodes: Episodes) -> dict[str, float]:
    """Lengths and the share cut off at the token budget (TRL's completions/* names)."""
    lengths = torch.tensor([len(c) for c in episodes.token_ids], dtype=torch.float32)
    truncated = torch.tensor([reason == "length" for reason in episodes.finish_reasons])
    return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean())}


def episode_metrics(episodes: Episodes, calls: int) -> dict[str, float]:
    """An environment's or agent's episodes: tool calls per episode, the share of tokens it wrote, its reward."""
    observed = episodes.observation_mask or []
    return {"tools/calls_per_episode": calls / max(len(episodes.token_ids), 1),
            "tools/observed_token_frac": sum(map(sum, observed)) / max(sum(map(len, observed)), 1),
            "tools/environment_reward": float(episodes.environment_rewards.mean())}


class RolloutStopped(RLHFInputError):
    """A rollout cannot go on (a hung call, every episode failed, a server down after its retries): the trainer
    stops the run with this line and the way to resume."""


# ---- Prompts: which prompts each rollout samples ----


@dataclass
class PromptBatch:
    """The prompts of rollout ``index`` (``positions``: their places in the prompt set, None when streaming)."""

    index: int
    prompts: list[dict[str, Any]]
    positions: list[int] | None = None


class PromptStream:
    """Every rollout's prompts, addressable by rollout index: an in-memory prompt set through a ResumableBatchSampler
    (each process its own share, a fresh seeded order per epoch, so rollout k's prompts are a pure function of k and
    a resumed run draws what the first one would have), or a streaming one read in order. ``per_rollout`` prompts per
    rollout and process; an epoch's short last batch repeats its prompts, so every step stays whole."""

    def __init__(self, dataset: Any, per_rollout: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.dataset, self.per_rollout = dataset, per_rollout
        self.streaming = isinstance(dataset, torch.utils.data.IterableDataset)
        if not self.streaming and len(dataset) == 0:
            raise RLHFInputError("the prompt set is empty after preprocessing")
        self.sampler = None if self.streaming else ResumableBatchSampler(len(dataset), per_rollout, seed, rank=rank,
                                                                          world_size=world_size)

    @property
    def batches_per_epoch(self) -> int | None:
        return None if self.sampler is None else self.sampler.batches_per_epoch

    def batches(self, first: int) -> Iterator[PromptBatch]:
        """The rollouts' prompts from rollout ``first`` on (a streaming set: from where it stands)."""
        if self.sampler is None:
            items, index = self._streaming(), first
            while True:
                yield PromptBatch(index, [next(items) for _ in range(self.per_rollout)])
                index += 1
        self.sampler.start = first
        for index, positions in enumerate(self.sampler, first):
            if len(positions) < self.per_rollout:  # an epoch's short last batch: its prompts again, to fill it
                positions = (positions * self.per_rollout)[:self.per_rollout]
            yield PromptBatch(index, [self.dataset[i] for i in positions], list(positions))

    def _streaming(self) -> Iterator[dict[str, Any]]:
        while True:
            yield from self.dataset
            if self.dataset.stats["records"] == 0:
                raise RLHFInputError("the streaming prompt set yielded no records")
            self.dataset.set_epoch(self.dataset.epoch + 1)

    def epoch(self, rollouts_done: float) -> float:
        if self.sampler is None:
            return float(getattr(self.dataset, "epoch", 0))
        return rollouts_done / self.sampler.batches_per_epoch


def with_lookahead(batches: Iterator[PromptBatch], ahead: int) -> Iterator[tuple[PromptBatch, list[PromptBatch]]]:
    """Each batch with the ``ahead`` batches that follow it (what a scheduler sampling ahead sends off next)."""
    if not ahead:
        for batch in batches:
            yield batch, []
        return
    window = collections.deque(itertools.islice(batches, ahead + 1))
    while window:
        current = window.popleft()
        yield current, list(window)
        following = next(batches, None)
        if following is not None:
            window.append(following)


# ---- Seeds: every rollout's random draws are a pure function of the run's seed and the rollout's index ----


def rollout_seed(seed: int, rollout_index: int, salt: int | None = None, process: int = 0) -> int:
    """The seed of rollout ``rollout_index``'s draws; with ``salt`` (ROLLOUT_SEED_SALTS), of one kind of draw made
    by one ``process``. A resumed run draws what the interrupted one did, whatever happened before."""
    base = seed * 1_000_003 + rollout_index
    return base if salt is None else base * salt + process


ROLLOUT_SEED_SALTS = {"sampling": 1009, "extra_prompts": 7919}
TURN_SEED_STRIDE = 7919  # a multi-turn episode's turn k (an agent's k-th batch of requests) samples at seed + k * this


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of a multi-turn rollout's ``turn``-th engine call, from the rollout's sampling seed."""
    return None if seed is None else seed + TURN_SEED_STRIDE * turn


def buffer_order_seed(seed: int, rollout_index: int) -> int:
    """PPO's experience-buffer order of rollout ``rollout_index`` (each pass adds its epoch)."""
    return seed * 1_000_003 + rollout_index * 101


def rollout_sampling_params(config: OnlineRLConfig, n: int, rollout_index: int, *, rank: int, world_size: int,
                            stop_token_ids: Sequence[int], suppress_token_ids: Sequence[int]) -> SamplingParams:
    """How rollout ``rollout_index`` samples ``n`` completions per prompt on process ``rank`` of ``world_size``.

    Processes share the global RNG state (one seed; a resume restores the main process's RNG on all), so they would
    draw the same noise for different prompts: several sample from a seed of their own. vLLM always gets one, from
    the rollout's index: its draws do not follow torch's RNG, and a resumed run must sample the interrupted rollout
    again alike. vLLM seeds each prompt from its place in the rollout across processes instead (seed_index_*): the
    interleaved sampler gives process r the places r, r + world_size, ... so any process count samples alike."""
    own_seed = world_size > 1 or config.use_vllm is not False
    by_place = config.use_vllm is True
    seed = (rollout_seed(config.seed, rollout_index, ROLLOUT_SEED_SALTS["sampling"], 0 if by_place else rank)
            if own_seed else None)
    return SamplingParams(seed_index_start=rank if by_place else 0, seed_index_stride=world_size if by_place else 1,
                          max_new_tokens=config.max_completion_length, temperature=config.temperature,
                          top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
                          repetition_penalty=config.repetition_penalty, n=n, seed=seed,
                          stop_token_ids=tuple(stop_token_ids), suppress_token_ids=tuple(suppress_token_ids))


# ---- Engines: what samples (inference_optimizations.RolloutEngine), the policy's weights it reads, its syncs ----


class PolicyWeightSource:
    """The training policy's weights as a rollout engine reads them, lazily, at each sync (PolicyWeights): full
    weights under their Hugging Face names, a LoRA policy's frozen base and its adapter, and a sharded policy's
    (FSDP2, ZeRO-3) gathered a tensor at a time by every process together (GatheredRead), with the gathered bytes
    alive at once metered (``meter``). ``prepared``: the module as prepared for training (what shards); ``step``: the
    optimizer step the weights are at."""

    def __init__(self, policy: PolicyModel, prepared: Callable[[], nn.Module], devices: DeviceManager,
                 step: Callable[[], int], sharded: bool = False) -> None:
        self.policy, self.prepared, self.devices, self.step, self.sharded = policy, prepared, devices, step, sharded
        self.meter: GatherMeter | None = None

    def module(self) -> nn.Module:
        model = self.devices.unwrap(self.policy.model)
        return getattr(model, "_orig_mod", model)

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights under their Hugging Face names, one tensor at a time (tied ones once)."""
        seen: set[int] = set()
        for name, tensor in self.module().state_dict().items():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            yield name, tensor.detach()

    def base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA policy's frozen base weights under the base model's own names."""
        seen: set[int] = set()
        for name, tensor in self.module().get_base_model().state_dict().items():
            if "lora_" not in name and tensor.data_ptr() not in seen:  # tied weights once
                seen.add(tensor.data_ptr())
                yield name.replace(".base_layer.", "."), tensor.detach()

    def reads(self) -> dict[str, GatheredRead]:
        """A sharded policy's weights as an engine reads them (each a collective every process iterates alike):
        ``named`` all of them, and for LoRA ``base`` (the frozen base under the base model's names) and ``adapter``
        (the LoRA tensors under the PEFT model's names)."""
        model, kind = self.module(), weight_sharding(self.prepared())

        def read(module: nn.Module, wanted: Callable[[str], bool] | None = None,
                 rename: Callable[[str], str] = str) -> GatheredRead:
            def gathered() -> Iterator[tuple[str, torch.Tensor]]:
                for name, tensor in gathered_named_tensors(module, kind, wanted, self.meter):
                    yield rename(name), tensor
                    del tensor  # not held while the next one is gathered

            return GatheredRead(gathered, lambda: [(rename(name), dtype, shape)
                                                   for name, dtype, shape in sharded_layout(module, kind, wanted)])

        reads = {"named": read(model)}
        if self.policy.is_peft:
            reads["base"] = read(model.get_base_model(), lambda name: "lora_" not in name,
                                 lambda name: name.replace(".base_layer.", "."))
            reads["adapter"] = read(model, lambda name: "lora_" in name)
        return reads

    def weights(self, reads: dict[str, GatheredRead] | None = None) -> PolicyWeights:
        """The policy's weights as of this optimizer step, read lazily by the engine's sync; a sharded policy's
        through ``reads`` (default ``reads()``)."""
        model, step = self.module(), self.step()
        if self.sharded:
            reads = reads or self.reads()
            return PolicyWeights(step, reads["named"], base=reads.get("base"), save_adapter=(
                (lambda directory: model.save_pretrained(directory, state_dict=dict(reads["adapter"]())))
                if self.policy.is_peft else None))
        if not self.policy.is_peft:
            return PolicyWeights(step, self.named)
        return PolicyWeights(step, self.named, base=self.base, save_adapter=model.save_pretrained)

    def write_start(self, directory: Path) -> None:
        """What a colocated engine loads first: the policy's weights, or for LoRA its base (adapters are synced on
        their own), with the tokenizer. A sharded policy's are gathered a tensor at a time into a file each."""
        model = self.module()
        target = model.get_base_model() if self.policy.is_peft else model
        if self.sharded:
            target.config.save_pretrained(directory)
            if getattr(target, "generation_config", None) is not None:
                target.generation_config.save_pretrained(directory)
            save_weight_shards(self.reads()["base" if self.policy.is_peft else "named"](), directory, shard_bytes=0)
        elif self.policy.is_peft:
            target.save_pretrained(directory, state_dict=dict(self.base()))
        else:
            model.save_pretrained(directory)
        self.policy.tokenizer.save_pretrained(directory)

    def sync_shared_from_shards(self, engine: RolloutEngine) -> None:
        """A shared engine (a server) synced from a sharded policy: the main process sends, and each weight read it
        makes (which ones depends on the engine, e.g. a LoRA base only once) is announced to the other processes
        first, which gather alongside and drop what they gather. A read left unfinished (an error) is gathered to its
        end before the processes part."""
        reads = self.reads()
        if not self.devices.is_main_process:
            while (kind := self.devices.broadcast_object(None)) != "done":
                collections.deque(reads[kind](), maxlen=0)  # each gathered tensor dropped before the next
            return
        opened: list[Iterator] = []

        def announced(kind: str) -> GatheredRead:
            def read() -> Iterator:
                self.devices.broadcast_object(kind)
                opened.append(reads[kind]())
                return opened[-1]

            return GatheredRead(read, reads[kind].layout)

        try:
            engine.sync_weights(self.weights({kind: announced(kind) for kind in reads}))
        finally:  # a read left unfinished (or never started) is gathered to its end, as the others do
            for generator in opened:
                with contextlib.suppress(ValueError):  # still running in a sender thread: it finishes there
                    collections.deque(generator, maxlen=0)
            self.devices.broadcast_object("done")


@dataclass
class EngineContext:
    """What a rollout engine's builder gets (ROLLOUT_ENGINES): the config, the policy and the devices it trains on,
    whether its weights are sharded, its weights (PolicyWeightSource), the context our engine samples in (eval mode,
    a sharded model's gathering) and the rollouts this run still plans (None where unknown), for ``auto``
    compilation."""

    config: OnlineRLConfig
    policy: PolicyModel
    devices: DeviceManager
    weights: PolicyWeightSource
    sampling_mode: Callable[[], contextlib.AbstractContextManager]
    rollouts_left: Callable[[], int | None]
    sharded: bool = False
    one_shape_per_rollout: bool = True  # the episode source samples one batch shape per rollout (a single turn)
    in_flight_updates: bool = False  # the scheduler has a server update its weights under running requests

    def expected_calls(self) -> int | None:
        """``generation_engine: auto`` compiles the decode step once a timed rollout shows the rollouts still planned
        would save more than the compilation costs (``inference_optimizations.compile_pays``). Episodes (an
        environment's turns, an agent's requests) come in batches of every size: no plan, so each shape is compiled
        only once its own past calls would have paid for it."""
        planned = self.config.generation_engine == "auto" and self.one_shape_per_rollout
        return self.rollouts_left() if planned else None


# -- rollout engines: one builder per engine, picked from the config; the trainer samples, syncs and closes through
# the protocol alone. Add an engine: its class in inference_optimizations.py, a builder here, and the config value
# that picks it in rollout_engine_name.
ROLLOUT_ENGINES: dict[str, Callable[[EngineContext], RolloutEngine]] = {}


def register_rollout_engine(name: str) -> Callable:
    """Decorator: ``builder(context: EngineContext) -> RolloutEngine`` becomes the engine ``name``, started at a
    run's first rollout."""
    def register(builder: Callable[[EngineContext], RolloutEngine]) -> Callable[[EngineContext], RolloutEngine]:
        ROLLOUT_ENGINES[name] = builder
        return builder
    return register


def rollout_engine_name(config: OnlineRLConfig) -> str:
    """The engine a config samples with: vLLM in this process or on a server (``use_vllm``, ``vllm_mode``), else
    ours, on the policy itself or a low-precision copy (``rollout_dtype``)."""
    if config.use_vllm == "auto":
        return "measured"
    if config.use_vllm:
        return f"vllm_{config.vllm_mode}"
    return "ours" if config.rollout_dtype == "auto" else f"ours_{config.rollout_dtype}"


@register_rollout_engine("ours")
def _our_rollout_engine(context: EngineContext) -> LocalEngine:
    """generate() on the policy being trained, with the run's generation_engine."""
    policy = context.policy
    return LocalEngine(lambda: context.devices.unwrap(policy.model), pad_token_id=policy.tokenizer.pad_token_id,
                       tokenizer=policy.tokenizer, engine=context.config.generation_engine, synced=context.sharded,
                       sampling_mode=context.sampling_mode, expected_calls=context.expected_calls,
                       vision_for=policy.vision_for)


def _our_quantized_rollout_engine(context: EngineContext) -> QuantizedEngine:
    """generate() on a low-precision copy of the policy (QuantizedEngine), synced after every step."""
    dtype, policy = context.config.rollout_dtype, context.policy
    if context.sharded:
        raise RLHFInputError(f"rollout_dtype {dtype}: the policy's weights are sharded across processes (FSDP / "
                             f"ZeRO-3), and the copy is made from whole weights; train with DDP, or set rollout_dtype: "
                             f"auto")
    try:
        return QuantizedEngine(context.devices.unwrap(policy.model), dtype=dtype, tokenizer=policy.tokenizer,
                               pad_token_id=policy.tokenizer.pad_token_id, engine=context.config.generation_engine)
    except ValueError as error:
        raise RLHFInputError(f"config field 'rollout_dtype' {error}") from None


for _dtype in QUANTIZED_ROLLOUT_DTYPES:
    register_rollout_engine(f"ours_{_dtype}")(_our_quantized_rollout_engine)


@register_rollout_engine("vllm_colocate")
def _vllm_colocate_engine(context: EngineContext) -> VLLMEngine:
    """vLLM in this process, started from the policy's weights (a LoRA policy's base) written to shared memory."""
    config = context.config
    start = run_folder("vllm-start")
    rank = getattr(config, "lora_rank", 8)
    try:
        context.weights.write_start(start)
        engine = VLLMEngine(str(start), dtype=_model_dtype(config), seed=config.seed,
                            max_model_len=config.vllm_max_model_len,
                            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                            tensor_parallel_size=config.vllm_tensor_parallel_size, enable_lora=context.policy.is_peft,
                            max_lora_rank=max(8, 1 << (max(rank, 1) - 1).bit_length()),
                            sleep_mode=config.vllm_enable_sleep_mode, owns_model=True)
    except BaseException:
        shutil.rmtree(start, ignore_errors=True)
        raise
    logger.info("vLLM engine (colocate) started in %.1f s", engine.start_seconds)
    return engine


def server_run_identity(output_dir: str | os.PathLike) -> tuple[str, str]:
    """(id, label) of this run to a vllm-serve it shares: the same in every process of the run (and in a resumed run),
    different for any run that could run beside it, since an output_dir holds one run at a time (RunFolderLock)."""
    import socket

    master = os.environ.get("MASTER_ADDR", "")
    host = master if master and not is_loopback(master) else socket.gethostname()
    folder = os.path.realpath(output_dir)
    return hashlib.sha256(f"{host}\0{folder}".encode()).hexdigest()[:32], f"{folder} on {host}"


@register_rollout_engine("vllm_server")
def _vllm_server_engine(context: EngineContext) -> VLLMClient | VLLMServerPool:
    """A client of ``rlhf.py vllm-serve`` (several: a VLLMServerPool); a server that is not there fails here, before
    any rollout (of a pool, at least one must answer)."""
    config = context.config
    transfer = config.vllm_weight_transfer
    if transfer == "auto":
        transfer = "collective" if context.devices.device.type == "cuda" else "files"
    addresses = ([str(entry).split("://")[-1].rstrip("/").rsplit(":", 1) for entry in config.vllm_servers]
                 if config.vllm_servers else [(config.vllm_server_host, config.vllm_server_port)])
    run, label = server_run_identity(config.output_dir)
    try:
        clients = _vllm_clients(config, addresses, transfer, context.in_flight_updates, run, label)
    except ValueError as error:  # a sync folder another user owns
        raise RLHFInputError(f"config field 'vllm_sync_dir': {error}") from None
    if len(clients) == 1:
        clients[0].health()
        return clients[0]
    pool = VLLMServerPool(clients)
    pool.health()
    return pool


def _vllm_clients(config: OnlineRLConfig, addresses: list, transfer: str, in_flight: bool, run: str,
                  label: str) -> list[VLLMClient]:
    """One client per server address, each writing its syncs to a folder of its own."""
    return [VLLMClient(host, int(port), timeout=config.vllm_server_timeout, retries=config.vllm_server_retries,
                       sync_dir=(Path(config.vllm_sync_dir) / f"server-{i}" if config.vllm_sync_dir and
                                 len(addresses) > 1 else config.vllm_sync_dir), weight_transfer=transfer,
                       in_flight=in_flight, run=run, run_label=label, sync_timeout=config.sync_timeout)
            for i, (host, port) in enumerate(addresses)]


VLLM_START_SECONDS = 10.0  # a colocated vLLM's start (weights to shared memory, engine, KV cache): 2-10 s on a CPU
EXPECTED_VLLM_GAIN = 0.4  # share of our engine's rollout time vLLM saves, until measured (1.6-2x at 23M-110M on a CPU)


class MeasuredEngineChoice:
    """``use_vllm: auto``: our engine or a colocated vLLM, whichever samples a rollout faster, by measurement.

    The first rollout is sampled by ours and timed. If the rollouts still planned would save more than vLLM's start
    (VLLM_START_SECONDS) at the expected gain (EXPECTED_VLLM_GAIN), vLLM is started, sent the current weights
    (timed: every later rollout pays one sync) and samples the second rollout (a trial, timed); vLLM keeps sampling
    when its rollout plus a sync took less than ours would have for as many tokens, else it is closed and ours
    samples the rest. The choice is measured anew by a resumed run. Each rollout is marked with the engine that
    sampled it (``holds_weights`` is the last sampler's), so a vLLM rollout gets the importance correction and one of
    ours needs none. A RolloutEngine (inference_optimizations.RolloutEngine) whose members follow the engine in use."""

    shared, takes_images = False, False

    def __init__(self, ours: RolloutEngine, start_vllm: Callable[[], RolloutEngine],
                 weights: Callable[[], PolicyWeights], rollouts_left: Callable[[], int | None]) -> None:
        self.ours, self.start_vllm, self.weights, self.rollouts_left = ours, start_vllm, weights, rollouts_left
        self.vllm: RolloutEngine | None = None
        self.active: RolloutEngine = ours  # samples the next rollout
        self.last: RolloutEngine = ours  # sampled the last one
        self.ours_seconds_per_token: float | None = None
        self.decided = False
        self.figures: dict[str, float] = {}

    @property
    def holds_weights(self) -> bool:
        return self.last.holds_weights

    @property
    def answers_evaluation(self) -> bool:
        return self.decided and self.active is self.vllm and getattr(self.vllm, "answers_evaluation", False)

    @property
    def metric_prefix(self) -> str:
        return getattr(self.last, "metric_prefix", "rollout")

    @property
    def logprobs_after_truncation(self) -> bool:
        return getattr(self.last, "logprobs_after_truncation", False)

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               images: list[list[str]] | None = None) -> GenerationOutput:
        if self.decided or self.ours_seconds_per_token is None:
            engine = self.active
            started = time.perf_counter()
            output = engine.sample(prompts, params, images)
            if not self.decided:
                self._after_ours(time.perf_counter() - started, _sampled_tokens(output))
            self.last = engine
            return output
        return self._trial(prompts, params, images)

    def _after_ours(self, seconds: float, tokens: int) -> None:
        """Our first rollout is timed: is a vLLM trial worth its start?"""
        self.ours_seconds_per_token = seconds / max(tokens, 1)
        left = self.rollouts_left()
        ahead = (left - 1) if left is not None else 0  # after this one
        if ahead * seconds * EXPECTED_VLLM_GAIN <= VLLM_START_SECONDS:
            self.decided = True
            logger.info("use_vllm=auto: our engine samples every rollout (a rollout took %.2f s; the %d left would "
                        "save about %.1f s with vLLM, less than its %.0f s start)", seconds, max(ahead, 0),
                        ahead * seconds * EXPECTED_VLLM_GAIN, VLLM_START_SECONDS)

    def _trial(self, prompts: list[list[int]], params: SamplingParams,
               images: list[list[str]] | None) -> GenerationOutput:
        """vLLM started and timed on one rollout and one weight sync; the faster engine samples from now on."""
        started = time.perf_counter()
        self.vllm = self.start_vllm()
        start_seconds = time.perf_counter() - started
        started = time.perf_counter()
        self.vllm.sync_weights(self.weights())  # a LoRA policy's adapter; what every later rollout pays
        sync_seconds = time.perf_counter() - started
        started = time.perf_counter()
        output = self.vllm.sample(prompts, params, images)
        sample_seconds = time.perf_counter() - started
        self.last, tokens = self.vllm, _sampled_tokens(output)
        ours = self.ours_seconds_per_token * tokens
        theirs = sample_seconds + sync_seconds
        self.figures = {"ours_s": ours, "vllm_s": theirs, "vllm_sample_s": sample_seconds,
                        "vllm_sync_s": sync_seconds, "vllm_start_s": start_seconds}
        self.decided = True
        keep = theirs < ours
        logger.info("use_vllm=auto: a rollout of %d tokens takes %.2f s with our engine, %.2f s with vLLM (sampling "
                    "%.2f s + weight sync %.2f s; it started in %.1f s): %s samples from now on", tokens, ours, theirs,
                    sample_seconds, sync_seconds, start_seconds, "vLLM" if keep else "our engine")
        if keep:
            self.active = self.vllm
        else:
            self.vllm.close()
        return output

    def sync_weights(self, weights: PolicyWeights) -> None:
        if self.active is self.vllm and self.vllm is not None:
            self.vllm.sync_weights(weights)

    def sleep(self) -> None:
        self.active.sleep()

    def close(self) -> None:
        for engine in (self.ours, self.vllm):
            if engine is not None:
                engine.close()


def _sampled_tokens(output: GenerationOutput) -> int:
    return sum(len(ids) for ids in output.token_ids)


@register_rollout_engine("measured")
def _measured_rollout_engine(context: EngineContext) -> RolloutEngine:
    """``use_vllm: auto``: ours, with a measured vLLM trial where vLLM can sample this run (MeasuredEngineChoice)."""
    ours = _our_rollout_engine(context)
    why_not = (vllm_missing() or ("the policy takes images" if context.policy.vision is not None else "")
               or ("several training processes (each would start its own vLLM): set use_vllm: true"
                   if context.devices.num_processes > 1 else "")
               or ("the policy is sharded" if context.sharded else ""))
    if why_not:
        logger.info("use_vllm=auto: our engine samples (%s)", why_not.rstrip("."))
        return ours
    return MeasuredEngineChoice(ours, lambda: _vllm_colocate_engine(context), context.weights.weights,
                                context.rollouts_left)


def engine_label(engine: RolloutEngine | None) -> str:
    """What samples, as the watchdog and error lines name it."""
    url = getattr(engine, "url", None)
    return f"the vLLM server {url}" if url else f"the rollout engine ({type(engine).__name__})"


class SyncedEngine:
    """The run's rollout engine, started at the first ``at(step)`` (ROLLOUT_ENGINES' pick, built by ``build``) and
    holding the weights of optimizer step ``step`` whenever it is handed out: an engine holding a copy (vLLM, a
    low-precision copy) is synced once per step, lazily, when a rollout or an evaluation first needs it. With several
    processes the main one syncs a shared engine (a server) and each syncs its own otherwise; a sharded policy's
    weights are gathered by every process together as the engine reads them. What the syncs measured waits in
    ``pop_metrics`` for the next rollout."""

    def __init__(self, build: Callable[[], RolloutEngine], weights: PolicyWeightSource, devices: DeviceManager) -> None:
        self.build, self.weights, self.devices = build, weights, devices
        self.engine: RolloutEngine | None = None
        self.step = -1  # the optimizer step whose weights the engine holds
        self.metrics: dict[str, float] = {}

    def at(self, step: int) -> RolloutEngine:
        if self.engine is None:
            self.engine = self.build()
        engine = self.engine
        if not engine.holds_weights or self.step == step:
            return engine
        started = time.time()
        weights = self.weights
        weights.meter = GatherMeter() if weights.sharded else None
        if weights.sharded and engine.shared and self.devices.num_processes > 1:
            weights.sync_shared_from_shards(engine)
        elif self.devices.is_main_process or not engine.shared:
            engine.sync_weights(weights.weights())
        if engine.shared:
            self.devices.wait()
        self.step = step
        self.metrics["perf/weight_sync_s"] = time.time() - started
        self.metrics.update(getattr(engine, "metrics", dict)())  # a server pool's live servers
        if weights.meter is not None:
            self.metrics["perf/weight_sync_gathered_peak_mb"] = weights.meter.peak / 2 ** 20
        return engine

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics

    @property
    def holds_weights(self) -> bool:
        return self.engine is not None and self.engine.holds_weights

    @property
    def metric_prefix(self) -> str:
        """Where the engine/trainer gap is logged: vllm/ for vLLM, rollout/ for any other engine holding a copy."""
        return getattr(self.engine, "metric_prefix", "rollout")

    @property
    def logprobs_after_truncation(self) -> bool:
        """Whether the engine's log-probs are of the top-k / top-p narrowed distribution it sampled from (vLLM's)."""
        return getattr(self.engine, "logprobs_after_truncation", False)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self.step = None, -1


# ---- Episode sources: what one sample of a prompt is (a turn, a tool conversation, an agent program's run) ----


@typing.runtime_checkable
class EpisodeSource(typing.Protocol):
    """What a rollout's samples are, given an engine to sample with (SkyRL's GeneratorInterface, verl's agent loops).

    ``sample(prompts, params, engine, watch) -> Episodes``: ``params.n`` episodes per prompt record (its
    ``prompt_ids``, ``messages``, ``answer``, ...), sampled with ``engine`` (a RolloutEngine already holding this
    step's weights); ``watch(what)`` tells the rollout's watchdog what runs now. It may run in a background thread
    (a scheduler sampling ahead) while the trainer's thread samples another rollout, so its per-rollout state is its
    own call's. ``close()`` releases what it holds (an endpoint). ``takes_images``: it samples image prompts;
    ``one_shape_per_rollout``: its engine calls have one batch shape per rollout (our engine may then plan compiling
    the decode step)."""

    takes_images: bool
    one_shape_per_rollout: bool

    def sample(self, prompts: list[dict[str, Any]], params: SamplingParams, engine: RolloutEngine,
               watch: Callable[[str], None]) -> Episodes: ...

    def close(self) -> None: ...


# the episode sources by name (EPISODE_SOURCES, section 0): ``episode_source`` picks one (auto: from ``environment``).
# A new source is one class under this banner, decorated @register_episode_source(name), built as
# cls(config, policy, formatter)


BUILT_IN_EPISODE_SOURCES = ("single_turn", "tool_environment", "agent_program")  # picked by environment (auto)


def implied_episode_source(environment: str | None) -> str:
    """What ``environment`` samples: one turn without one, an agent program with ``agent``, else a tool environment."""
    return "single_turn" if not environment else "agent_program" if environment == "agent" else "tool_environment"


def episode_source_name(config: OnlineRLConfig) -> str:
    """The source a config samples episodes with: ``episode_source``, or for auto, the one its ``environment``
    implies."""
    chosen = getattr(config, "episode_source", "auto")
    return chosen if chosen != "auto" else implied_episode_source(getattr(config, "environment", None))


@register_episode_source("single_turn")
class SingleTurnSource:
    """One engine call: each sample is the engine's completion of its prompt (image prompts included)."""

    takes_images, one_shape_per_rollout = True, True

    def __init__(self, config: OnlineRLConfig, policy: PolicyModel, formatter: ChatFormatter) -> None:
        pass

    def sample(self, prompts: list[dict[str, Any]], params: SamplingParams, engine: RolloutEngine,
               watch: Callable[[str], None]) -> Episodes:
        images = [p.get("images") or [] for p in prompts]  # a vision-language policy's image prompts
        watch(engine_label(engine))
        output = engine.sample([p["prompt_ids"] for p in prompts], params, images if any(images) else None)
        return Episodes(output.token_ids, output.logprobs, output.finish_reasons,
                        [p for p in prompts for _ in range(params.n)], policy_version=output.policy_version,
                        token_versions=output.token_versions)

    def close(self) -> None:
        pass


@dataclass
class _OpenEpisodes:
    """A tool environment's episodes while they play: per episode its environment, context, completion so far (with
    the engine's log-probs, 0 for observed tokens, and which tokens were observed), conversation, summed reward and
    finish reason."""

    records: list[dict[str, Any]]
    envs: list[Any]
    context: list[list[int]]
    conversations: list[list[dict[str, Any]]]
    tokens: list[list[int]] = field(default_factory=list)
    logps: list[list[float]] = field(default_factory=list)
    observed: list[list[bool]] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    reasons: list[str] = field(default_factory=list)
    failed: list[bool] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    calls: int = 0
    versions: list[list[int | None]] = field(default_factory=list)  # per token: the weights that sampled it
    oldest: int | None = None  # the oldest weights any turn was sampled with

    def __post_init__(self) -> None:
        count = len(self.records)
        self.tokens, self.logps, self.observed, self.versions = ([[] for _ in range(count)] for _ in range(4))
        self.rewards, self.reasons, self.failed = torch.zeros(count), ["stop"] * count, [False] * count


@register_episode_source("tool_environment")
class ToolEnvironmentSource:
    """Multi-turn episodes with an environment (``environment``: calculator, http, or module:function returning an
    Environment), batched turn by turn: every open episode generates a turn (at most max_turn_tokens, and what is
    left of max_completion_length), its environment answers, and the answer's tokens join the completion marked as
    observed, never trained on. An episode ends when its environment says so, after max_turns turns, or when the
    completion's budget is spent (finish reason ``length``). An environment call that keeps failing
    (rollout_retries, environment_timeout) drops its episode."""

    takes_images, one_shape_per_rollout = False, False

    def __init__(self, config: OnlineRLConfig, policy: PolicyModel, formatter: ChatFormatter) -> None:
        self.config, self.policy, self.formatter = config, policy, formatter
        self.make: Callable[[], Any] | None = None  # the environment factory, loaded at the first rollout

    def sample(self, prompts: list[dict[str, Any]], params: SamplingParams, engine: RolloutEngine,
               watch: Callable[[str], None]) -> Episodes:
        config = self.config
        self.make = self.make or environment_factory(config)
        records = [p for p in prompts for _ in range(params.n)]
        episodes = _OpenEpisodes(records, [self.make() for _ in records], [list(r["prompt_ids"]) for r in records],
                                 [list(r["messages"]) for r in records])
        active = self._reset_all(episodes, watch)
        for turn in range(config.max_turns):
            if not active:
                break
            active = self._play_turn(episodes, active, turn, params, engine, watch)
        return self._finish(episodes, params)

    def _call(self, episodes: _OpenEpisodes, i: int, what: str, call: Callable[[], Any],
              watch: Callable[[str], None]) -> Any:
        """An environment's reset or step, timed out and retried (an HTTP environment times and retries its own
        requests); EnvironmentFault, with the episode marked failed, once it keeps failing."""
        own = isinstance(episodes.envs[i], HTTPEnvironment)
        watch(f"environment {self.config.environment!r} ({what}, episode {i})")
        value, error = guarded_call(call, 1 if own else 1 + self.config.rollout_retries,
                                    timeout=None if own else self.config.environment_timeout)
        if error is not None:
            episodes.failed[i] = True
            episodes.faults.append(f"{what}: {type(error).__name__}: {error}")
            raise EnvironmentFault(str(error))
        return value

    def _observe(self, episodes: _OpenEpisodes, i: int, ids: list[int]) -> None:
        ids = ids[:self.config.max_completion_length - len(episodes.tokens[i])]
        episodes.tokens[i] += ids
        episodes.logps[i] += [0.0] * len(ids)
        episodes.observed[i] += [True] * len(ids)
        episodes.versions[i] += [None] * len(ids)
        episodes.context[i] += ids

    def _reset_all(self, episodes: _OpenEpisodes, watch: Callable[[str], None]) -> list[int]:
        """Every episode's environment reset (a retried reset starts from a new environment); its first observation
        joins the completion. Returns the episodes still open."""
        for i, record in enumerate(episodes.records):
            def fresh(i: int = i, record: dict[str, Any] = record) -> str | None:
                episodes.envs[i] = self.make()
                return episodes.envs[i].reset(record)

            try:
                first = self._call(episodes, i, "reset", fresh, watch)
            except EnvironmentFault:
                continue
            if first:
                self._observe(episodes, i, self.policy.tokenizer(first, add_special_tokens=False)["input_ids"])
        return [i for i in range(len(episodes.records))
                if len(episodes.tokens[i]) < self.config.max_completion_length and not episodes.failed[i]]

    def _play_turn(self, episodes: _OpenEpisodes, active: list[int], turn: int, params: SamplingParams,
                   engine: RolloutEngine, watch: Callable[[str], None]) -> list[int]:
        """One turn of every open episode: sampled in one engine call, then each environment's answer. Returns the
        episodes still open."""
        config, budget = self.config, self.config.max_completion_length
        room = {i: budget - len(episodes.tokens[i]) for i in active}
        turn_params = dataclasses.replace(params, n=1, max_new_tokens=min(config.max_turn_tokens or budget,
                                                                           max(room.values())),
                                          stop_strings=(config.tool_tags[1],) if config.tool_format == "tag" else (),
                                          seed=turn_seed(params.seed, turn))
        watch(f"{engine_label(engine)} (turn {turn + 1})")
        out = engine.sample([episodes.context[i] for i in active], turn_params)
        versions = out.token_versions or [[out.policy_version] * len(ids) for ids in out.token_ids]
        if out.policy_version is not None:
            episodes.oldest = min(out.policy_version, episodes.oldest if episodes.oldest is not None else math.inf)
        still = []
        for i, new, new_logps, reason, new_versions in zip(active, out.token_ids, out.logprobs, out.finish_reasons,
                                                            versions):
            new = new[:room[i]]
            episodes.tokens[i] += new
            episodes.logps[i] += new_logps[:len(new)]
            episodes.observed[i] += [False] * len(new)
            episodes.versions[i] += list(new_versions[:len(new)])
            episodes.context[i] += new
            try:
                observation, reward, done = self._call(episodes, i, f"step {turn + 1}", functools.partial(
                    episodes.envs[i].step, self.policy.decode(new)), watch)
            except EnvironmentFault:
                continue
            episodes.rewards[i] += reward
            spent = len(episodes.tokens[i]) >= budget
            if done or observation is None or turn + 1 == config.max_turns or spent:
                episodes.reasons[i] = "length" if spent or (reason == "length" and not done) else "stop"
                continue
            episodes.calls += 1
            self._observe(episodes, i, self._observation_ids(episodes.records[i], episodes.conversations[i], new,
                                                             observation))
            if len(episodes.tokens[i]) >= budget:
                episodes.reasons[i] = "length"
                continue
            still.append(i)
        return still

    def _finish(self, episodes: _OpenEpisodes, params: SamplingParams) -> Episodes:
        if episodes.faults:
            logger.warning("environment %r failed in %d of %d episodes after %d attempts per call (last: %s); they "
                           "are dropped", self.config.environment, sum(episodes.failed), len(episodes.records),
                           1 + self.config.rollout_retries, episodes.faults[-1])
        out = Episodes(episodes.tokens, episodes.logps, episodes.reasons, episodes.records,
                       observation_mask=episodes.observed, environment_rewards=episodes.rewards,
                       failed=episodes.failed, policy_version=episodes.oldest, token_versions=episodes.versions)
        out.metrics = episode_metrics(out, episodes.calls)
        return out

    def _observation_ids(self, record: dict[str, Any], conversation: list[dict[str, Any]], turn_ids: list[int],
                         observation: str) -> list[int]:
        """The tokens an environment's answer adds. ``tag``: its text, inline in the assistant's turn.
        ``chat_template``: what the chat template writes after this assistant turn's end-of-turn token for a
        ``tool`` message, through the next assistant turn's header, so the next turn is generated as the model
        was taught (the rest of the end-of-turn text, e.g. ChatML's newline, included)."""
        encode = self.formatter.encode
        if self.config.tool_format == "tag":
            return encode(observation)
        text = self.policy.decode(turn_ids)
        ended = turn_ids[-1:] if turn_ids and turn_ids[-1] in self.formatter.stop_token_ids else []
        generated = text + self.policy.tokenizer.decode(ended)
        conversation += [{"role": "assistant", "content": text}, {"role": "tool", "content": observation}]
        rendered = self.formatter.render(record.get("system"), conversation, True, "record", record.get("tools"))
        where = rendered.rfind(generated, 0, rendered.rfind(observation))
        if where < 0:
            raise RLHFInputError("tool_format chat_template: this chat template does not write an assistant turn as "
                                 "the model generated it, so tool messages cannot be appended token by token; use "
                                 "tool_format: tag")
        return encode(rendered[where + len(generated):])

    def close(self) -> None:
        pass


@dataclass
class AgentRollout:
    """One rollout's agent episodes while they run: episode numbers ``first`` .. ``first + len(records) - 1`` on the
    endpoint, each episode's record and prompt text as the run's template writes it, and its requests so far."""

    first: int
    records: list[dict[str, Any]]
    texts: list[str]
    calls: list[list[AgentCall]]
    warned: set[str] = field(default_factory=set)
    # each episode's own API key (its client's; no other episode's client, or other local process, can post into
    # its trajectory) and its requests admitted so far (counted when admitted, so concurrent ones cannot pass
    # max_turns)
    keys: list[str] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = self.keys or [secrets.token_urlsafe(24) for _ in self.records]
        self.admitted = self.admitted or [0] * len(self.records)

    def owns(self, episode: int) -> bool:
        return 0 <= episode - self.first < len(self.records)


def _trajectory_versions(calls: list[AgentCall], per_call: bool) -> list[int | None]:
    """The weight version of each token of an episode's trajectory (None where the agent wrote it), aligned as
    concatenated_trajectory (or, per call, the calls' answers joined) lays the tokens out."""
    if per_call:
        return [v for call in calls for v in call.versions]
    versions, context = [], len(calls[0].prompt_ids)
    for call in calls:
        versions += [None] * (len(call.prompt_ids) - context) + list(call.versions)
        context = len(call.prompt_ids) + len(call.token_ids)
    return versions


@register_episode_source("agent_program")
class AgentProgramSource:
    """Episodes played by the user's agent program (``agent``: module:function(client, record) -> reward), each run in
    a thread of its own with an ``openai.OpenAI`` client on its episode's address of an OpenAI-compatible endpoint
    (AgentEndpoint) it owns. The sampling thread samples the requests as they come, batched across episodes
    (AgentEndpoint.take), with the rollout engine; an agent that raises is run again (rollout_retries), then its
    episode is dropped. Each episode becomes one trajectory (concatenated_trajectory), or with agent_trajectory
    per_call keeps its requests apart (``Episodes.calls``); its reward is the agent's."""

    takes_images, one_shape_per_rollout = False, False

    def __init__(self, config: OnlineRLConfig, policy: PolicyModel, formatter: ChatFormatter) -> None:
        self.config, self.policy, self.formatter = config, policy, formatter
        self.agent: Callable[..., float] | None = None
        self.endpoint: AgentEndpoint | None = None
        self.episodes_started = 0
        self.running: dict[int, AgentRollout] = {}  # by first episode: rollouts whose agents run now
        self.lock = threading.Lock()  # a scheduler sampling ahead runs a rollout beside the trainer thread's

    def sample(self, prompts: list[dict[str, Any]], params: SamplingParams, engine: RolloutEngine,
               watch: Callable[[str], None]) -> Episodes:
        try:
            import openai
        except ImportError:
            raise RLHFInputError("environment: agent gives each agent an openai.OpenAI client, and the openai package "
                                 "is not installed: pip install openai") from None
        config = self.config
        records = [p for p in prompts for _ in range(params.n)]
        texts = [self.policy.tokenizer.decode(r["prompt_ids"], skip_special_tokens=False) for r in records]
        with self.lock:
            self.agent = self.agent or _import_callable(config.agent or "", "agent", f"cannot load {config.agent!r}",
                                                        "give module:function(client, record) -> reward")
            if self.endpoint is None:
                self.endpoint = AgentEndpoint(self.prepare, functools.partial(openai_answer,
                                                                              tokenizer=self.policy.tokenizer),
                                              self.key_for, port=config.agent_port,
                                              timeout=config.rollout_timeout or 1e9)
            state = AgentRollout(self.episodes_started, records, texts, [[] for _ in records])
            self.episodes_started += len(records)
            self.running[state.first] = state
        try:
            rewards = self._run_agents(state, params, engine, watch, openai.OpenAI)
        finally:
            with self.lock:
                self.running.pop(state.first, None)
        return self._trajectories(state, rewards)

    def _run_agents(self, state: AgentRollout, params: SamplingParams, engine: RolloutEngine,
                    watch: Callable[[str], None], client_class: type) -> list[tuple[float | None, str]]:
        """Every episode's agent in a thread, its requests sampled here as they come; (reward, '') per episode, or
        (None, why) for one whose agent kept failing."""
        config, endpoint = self.config, self.endpoint
        # what the agent gets: the record (messages, answer, ...) and prompt_text, the prompt as the run's chat
        # template writes it, for agents that use the completions API
        view = [{**{k: v for k, v in r.items() if k != "prompt_ids"}, "prompt_text": text}
                for r, text in zip(state.records, state.texts)]

        def attempt(i: int) -> float:
            with self.lock:
                state.calls[i], state.admitted[i] = [], 0
            client = client_class(base_url=endpoint.base_url(state.first + i), api_key=state.keys[i], max_retries=2,
                                  timeout=config.rollout_timeout or None)  # retries: connection errors only
            reward = self.agent(client, copy.deepcopy(view[i]))
            if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
                raise RLHFInputError(f"agent {config.agent} returned {reward!r}; return the episode's reward as a "
                                     f"finite number")
            return float(reward)

        def play(i: int) -> tuple[float | None, str]:
            reward, error = guarded_call(functools.partial(attempt, i), 1 + config.rollout_retries)
            return (reward, "") if error is None else (None, f"{type(error).__name__}: {error}")

        batches, episodes = 0, range(state.first, state.first + len(state.records))
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(state.records), thread_name_prefix="rlhf-agent")
        try:
            futures = [pool.submit(play, i) for i in range(len(state.records))]
            while True:
                calls = endpoint.take(lambda: sum(not f.done() for f in futures), linger=config.agent_batch_wait,
                                      episodes=episodes)
                if not calls:
                    break  # every episode is over
                self._sample_calls(state, engine, calls, params, batches, watch)
                batches += 1
        except BaseException:  # the run stops (a hang, an interrupt): answer what waits, leave the agents behind
            for call in endpoint.take(lambda: 0, episodes=episodes):
                call.error = "the rollout stopped"
                call.done.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return [future.result() for future in futures]

    def _sample_calls(self, state: AgentRollout, engine: RolloutEngine, calls: list[AgentCall],
                      params: SamplingParams, batch: int, watch: Callable[[str], None]) -> None:
        """One batch of agents' requests sampled by the engine (one ``sample`` per distinct set of stop strings),
        each cut to its own budget, recorded under its episode and answered."""
        def record(call: AgentCall) -> None:
            if state.owns(call.episode):
                state.calls[call.episode - state.first].append(call)
            call.done.set()

        for call in [c for c in calls if c.max_new_tokens == 0]:
            call.finish_reason = "length"
            record(call)
        calls = [c for c in calls if c.max_new_tokens > 0]
        for stop in dict.fromkeys(c.stop for c in calls):
            group = [c for c in calls if c.stop == stop]
            watch(f"{engine_label(engine)} (agent requests, batch {batch + 1})")
            call_params = dataclasses.replace(params, n=1, max_new_tokens=max(c.max_new_tokens for c in group),
                                              stop_strings=tuple(params.stop_strings or ()) + stop,
                                              seed=turn_seed(params.seed, batch + 1))
            try:
                out = engine.sample([c.prompt_ids for c in group], call_params)
            except Exception as error:
                for call in group:
                    call.error = f"sampling failed: {error}"
                    call.done.set()
                if isinstance(error, (ValueError, torch.OutOfMemoryError)):  # these requests', not the engine's
                    logger.warning("agent requests of %d episodes failed to sample (%s); those episodes fail",
                                   len(group), error)
                    continue
                raise
            versions = out.token_versions or [[out.policy_version] * len(ids) for ids in out.token_ids]
            for call, ids, lps, reason, sampled_by in zip(group, out.token_ids, out.logprobs, out.finish_reasons,
                                                          versions):
                call.token_ids, call.logprobs = list(ids[:call.max_new_tokens]), list(lps[:call.max_new_tokens])
                call.versions = list(sampled_by[:call.max_new_tokens])
                call.finish_reason = "length" if len(ids) > call.max_new_tokens else reason
                record(call)

    def _trajectories(self, state: AgentRollout, results: list[tuple[float | None, str]]) -> Episodes:
        """Each episode as one trajectory (or its requests apart, per_call), its reward the agent's; an episode whose
        agent failed or made no request, or whose requests do not extend each other, is dropped."""
        per_call = self.config.agent_trajectory == "per_call"
        tokens, logps, observed, reasons, rewards, failed, kept, faults = [], [], [], [], [], [], [], []
        versions: list[list[int | None]] = []
        for i, (reward, why) in enumerate(results):
            calls = [c for c in state.calls[i] if not c.error]
            try:
                if why:
                    raise EnvironmentFault(why)
                if not calls:
                    raise EnvironmentFault("the agent made no request")
                if per_call:  # the rows come from the calls (per_call_rows); the episode's answers, joined, are what
                    # reward functions and metrics read
                    prompt, ids = calls[0].prompt_ids, [t for c in calls for t in c.token_ids]
                    lps, seen = [lp for c in calls for lp in c.logprobs], [False] * len(ids)
                else:
                    prompt, ids, lps, seen = concatenated_trajectory(calls)
            except (EnvironmentFault, ValueError) as error:
                faults.append(f"episode {i}: {error}")
                prompt, ids, lps, seen, reward = state.records[i]["prompt_ids"], [], [], [], 0.0
                failed.append(True)
            else:
                failed.append(False)
            kept.append({**state.records[i], "prompt_ids": list(prompt)})
            tokens.append(ids)
            logps.append(lps)
            observed.append(seen)
            versions.append(_trajectory_versions(calls, per_call) if ids else [])
            reasons.append(calls[-1].finish_reason if calls and not failed[-1] else "stop")
            rewards.append(reward)
        if faults:
            logger.warning("agent %s failed in %d of %d episodes (last: %s); they are dropped", self.config.agent,
                           sum(failed), len(state.records), faults[-1])
        sampled_by = [v for row in versions for v in row if v is not None]
        episodes = Episodes(tokens, logps, reasons, kept, observation_mask=observed, failed=failed,
                            environment_rewards=torch.tensor(rewards, dtype=torch.float32), token_versions=versions,
                            policy_version=min(sampled_by) if sampled_by else None)
        if per_call:
            episodes.calls = [[] if failed[i] else [(c.prompt_ids, c.token_ids, c.logprobs, c.finish_reason)
                                                   for c in state.calls[i] if not c.error]
                              for i in range(len(state.records))]
        episodes.metrics = episode_metrics(episodes, sum(len(c) for c in state.calls))
        return episodes

    def prepare(self, episode: int, body: dict[str, Any], kind: str) -> tuple[str, list[int], int, tuple[str, ...]]:
        """A request's prompt text and ids, token budget and stop strings (AgentEndpoint's ``prepare``; a request
        thread)."""
        config = self.config
        state = self._state_of(episode)
        if state is None:
            raise ValueError(f"episode {episode} is not running")
        index = episode - state.first
        with self.lock:
            calls = list(state.calls[index])
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise ValueError("messages must be a non-empty list of {role, content} objects")
            try:
                text = self.formatter.render("", messages, True, "agent request", body.get("tools"))
            except RLHFInputError as error:
                raise ValueError(str(error)) from None
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise ValueError("prompt must be one string")
        prompt_ids = self.formatter.encode(text)
        if (body.get("n") or 1) != 1:
            raise ValueError("n must be 1: each request is one sample of the episode")
        if not calls and text == state.texts[index]:  # the record's prompt as the run encoded it
            prompt_ids = list(state.records[index]["prompt_ids"])
        if calls:  # token in, token out: a request whose text extends the last request and its answer gets the
            # sampled ids back as sampled, not re-encoded from their text (which need not give them back), so the
            # model conditions on the trajectory it will be trained on
            last = calls[-1]
            before = last.prompt_text + self.policy.tokenizer.decode(last.token_ids, skip_special_tokens=False)
            if text.startswith(before):
                prompt_ids = list(last.prompt_ids) + list(last.token_ids) + self.formatter.encode(text[len(before):])
        context = getattr(getattr(self.policy.model, "config", None), "max_position_embeddings", None)
        if isinstance(context, int) and len(prompt_ids) >= context:  # it would fail the batch it is sampled in
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, and the model's context holds {context}")
        temperature = body.get("temperature")
        if temperature is not None and abs(float(temperature) - config.temperature) > 1e-9 \
                and "temperature" not in state.warned:
            state.warned.add("temperature")
            logger.warning("agent requests ask for temperature %s; the run samples at its own temperature %s, the one "
                           "its loss assumes", temperature, config.temperature)
        room = config.max_completion_length - (len(prompt_ids) - len(calls[0].prompt_ids) if calls else 0)
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or room
        # an episode whose budget (max_completion_length, what the agent added included) is spent is answered with
        # nothing and finish_reason length, as an OpenAI server answers max_tokens reached
        budget = max(0, min(int(asked), config.max_turn_tokens or config.max_completion_length, room))
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(str(s) for s in stop)
        with self.lock:  # counted as admitted, so that concurrent requests of one episode cannot pass max_turns
            if state.admitted[index] >= config.max_turns:
                raise ValueError(f"this episode made its {config.max_turns} requests (max_turns)")
            state.admitted[index] += 1
        return text, prompt_ids, budget, stop

    def _state_of(self, episode: int) -> AgentRollout | None:
        with self.lock:
            return next((s for s in self.running.values() if s.owns(episode)), None)

    def key_for(self, episode: int) -> str | None:
        """Episode ``episode``'s API key while it runs (AgentEndpoint's ``key_for``)."""
        state = self._state_of(episode)
        return state.keys[episode - state.first] if state is not None else None

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


# ---- Rollout schedulers: when each rollout is sampled, and with which weights ----


@typing.runtime_checkable
class RolloutScheduler(typing.Protocol):
    """When a rollout's episodes are sampled relative to training (TRL's RolloutWorker, prime-rl's Dispatcher).

    ``lookahead``: how many later rollouts' prompts it wants to know about; ``plan(upcoming)``: those rollouts'
    PromptBatches, told before each rollout is sampled; ``sample(prompts, n, index, step, watch) -> Episodes``: rollout
    ``index``'s episodes (``n`` per prompt) for the trainer at optimizer step ``step``, with what it measured in
    ``Episodes.metrics``; ``close()``: stop what runs in the background (idempotent). A scheduler that samples ahead
    also has ``buffered()`` (its rollouts sampled ahead, once done: a checkpoint keeps them) and ``restore(buffer,
    dropped)``, so that a resumed run trains on exactly what the interrupted one would have."""

    lookahead: int

    def plan(self, upcoming: list[PromptBatch]) -> None: ...

    def sample(self, prompts: list[dict[str, Any]], n: int, index: int, step: int,
               watch: Callable[[str], None]) -> Episodes: ...

    def close(self) -> None: ...


# the schedulers by name (ROLLOUT_SCHEDULERS, section 0): ``rollout_scheduler`` picks one (auto: from max_staleness). A
# new scheduler is one class under this banner, decorated @register_rollout_scheduler(name), built as
# cls(config, source, engine, params_for, steps_per_rollout)


def rollout_scheduler_name(config: OnlineRLConfig) -> str:
    """The scheduler a config samples with: ``rollout_scheduler``, or for auto, sync when on-policy (max_staleness 0)
    and bounded_staleness otherwise."""
    chosen = getattr(config, "rollout_scheduler", "auto")
    if chosen != "auto":
        return chosen
    return "bounded_staleness" if getattr(config, "max_staleness", 0) else "sync"


@register_rollout_scheduler("sync")
class SyncScheduler:
    """On-policy: each rollout is sampled when training needs it, by the engine holding this step's weights."""

    lookahead = 0

    def __init__(self, config: OnlineRLConfig, source: EpisodeSource, engine: SyncedEngine,
                 params_for: Callable[[int, int], SamplingParams], steps_per_rollout: int = 1) -> None:
        self.source, self.engine, self.params_for = source, engine, params_for

    def plan(self, upcoming: list[PromptBatch]) -> None:
        pass

    def sample(self, prompts: list[dict[str, Any]], n: int, index: int, step: int,
               watch: Callable[[str], None]) -> Episodes:
        engine = self.engine.at(step)
        episodes = self.source.sample(prompts, self.params_for(n, index), engine, watch)
        engine.sleep()
        episodes.metrics.update(self.engine.pop_metrics())
        return episodes

    def close(self) -> None:
        pass


@register_rollout_scheduler("bounded_staleness")
class BoundedStalenessScheduler:
    """Fully async rollouts (``max_staleness`` k, a shared engine: a vLLM server): the rollouts of the next k
    optimizer steps are sampled in a background thread while the policy trains, each sent off right after a weight
    sync. Each sampled rollout carries the optimizer step of the weights that sampled it (``policy_version``); one
    older than k steps when its turn comes is dropped and counted, and its prompts are sampled again then. The
    trainer's importance correction compares the behaviour log-probs with the policy trained. With k = 1
    (``async_rollouts``) the next rollout is sampled while this one trains (one step off-policy)."""

    def __init__(self, config: OnlineRLConfig, source: EpisodeSource, engine: SyncedEngine,
                 params_for: Callable[[int, int], SamplingParams], steps_per_rollout: int = 1) -> None:
        self.source, self.engine, self.params_for = source, engine, params_for
        self.max_staleness = config.max_staleness
        # a rollout sent off k rollouts ahead is trained on k rollouts later, so its staleness at its first step is at
        # most max_staleness (its later steps, with steps_per_rollout > 1, come after)
        self.lookahead = config.max_staleness // steps_per_rollout
        self.in_flight: collections.deque = collections.deque()  # (prompt ids, future), oldest first
        self.upcoming: list[PromptBatch] = []
        self.dropped = 0  # completions sampled ahead and dropped for being older than max_staleness
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def plan(self, upcoming: list[PromptBatch]) -> None:
        self.upcoming = upcoming

    sync_before_waiting = False  # whether this step's weights go to the engine before the rollout is waited for

    def sample(self, prompts: list[dict[str, Any]], n: int, index: int, step: int,
               watch: Callable[[str], None]) -> Episodes:
        engine = self.engine.at(step) if self.sync_before_waiting else None
        waited = time.time()
        ids, episodes = [p["prompt_ids"] for p in prompts], None
        if self.in_flight and self.in_flight[0][0] == ids:  # else extra prompts (dynamic_sampling's)
            watch(engine_label(self.engine.engine))
            episodes = self.in_flight.popleft()[1].result()
        metrics = {"perf/rollout_wait_s": time.time() - waited}
        engine = engine or self.engine.at(step)
        staleness = step - episodes.policy_version if episodes is not None and episodes.policy_version is not None \
            else 0
        if episodes is not None and (episodes.policy_version is None or staleness > self.max_staleness):
            self.dropped += len(episodes.token_ids)
            logger.warning("rollout %d was sampled with the weights of step %s, more than max_staleness=%d steps "
                           "before step %d: dropped (%d completions so far), its prompts sampled again", index,
                           episodes.policy_version, self.max_staleness, step, self.dropped)
            episodes = None
        if episodes is None:  # the first rollout (or the first after a resume, or a stale one) samples now
            watch(engine_label(engine))
            episodes, staleness = self.source.sample(prompts, self.params_for(n, index), engine, watch), 0
        metrics.update({"rollout/staleness": float(staleness), "rollout/stale_dropped": float(self.dropped),
                        **token_version_metrics(episodes, step)})
        self._send_off(engine, n, index)
        episodes.metrics.update({**metrics, **self.engine.pop_metrics()})
        return episodes

    def buffered(self) -> list[tuple[list[list[int]], Episodes]]:
        """The rollouts sampled ahead, oldest first, each once it is done (a checkpoint waits for them): what a
        resumed run must train on next to repeat this one."""
        return [(ids, future.result()) for ids, future in self.in_flight]

    def restore(self, buffer: list[tuple[list[list[int]], Episodes]], dropped: int = 0) -> None:
        """A checkpoint's rollouts sampled ahead, trained on next as if never interrupted."""
        for ids, episodes in buffer:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(episodes)
            self.in_flight.append((ids, done))
        self.dropped = dropped

    def _send_off(self, engine: RolloutEngine, n: int, index: int) -> None:
        """The next rollouts not yet in flight, sampled in the background with the weights the engine holds now."""
        self.pool = self.pool or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlhf-rollouts")
        for position, batch in enumerate(self.upcoming):
            if position >= len(self.in_flight):
                params = self.params_for(n, index + 1 + position)
                self.in_flight.append(([p["prompt_ids"] for p in batch.prompts],
                                       self.pool.submit(self.source.sample, batch.prompts, params, engine,
                                                        lambda what: None)))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.in_flight.clear()


@register_rollout_scheduler("in_flight")
class InFlightScheduler(BoundedStalenessScheduler):
    """Bounded staleness with in-flight weight updates (NeMo-RL, SkyRL, AReaL, prime-rl; vllm_mode: server): the
    rollouts of the next max_staleness steps are sampled in the background as with bounded_staleness, but a weight
    sync does not wait for the server's running requests: they pause between two engine steps, the new weights are
    loaded, and they go on with them (VLLMStepLoop). A completion sampled across syncs holds tokens of several
    versions; each token carries the version and the behaviour log-prob it was sampled with, so the trainer's
    importance correction compares each token with the weights that actually sampled it. A rollout is dropped when
    its oldest token is more than max_staleness steps old. Each step's weights go to the server first, before the
    trainer waits for the rollout it trains on next, so that rollout's remaining tokens are sampled with them."""

    updates_weights_in_flight = True
    sync_before_waiting = True


def token_version_metrics(episodes: Episodes, step: int) -> dict[str, float]:
    """Staleness per sampled token at training step ``step`` (where tokens carry the weights that sampled them), and
    the share of completions sampled by more than one version of the weights (in-flight updates)."""
    rows = [[v for v in row if v is not None] for row in episodes.token_versions or []]
    stale = [step - v for row in rows for v in row]
    if not stale:
        return {}
    return {"rollout/token_staleness_mean": sum(stale) / len(stale), "rollout/token_staleness_max": float(max(stale)),
            "rollout/mixed_version_frac": sum(len(set(row)) > 1 for row in rows) / len(rows)}


# ---- Scores: rewards of sampled episodes, with the faults of reward functions and environments ----


@dataclass
class Scores:
    """Rewards of a rollout's completions (what the advantages see: the reward functions' and an environment's or
    agent's), which completions failed (their episode or their reward, after the retries), why the steps on this
    rollout must skip their update ('' when none), and what scoring measured."""

    rewards: torch.Tensor
    failed: torch.Tensor
    skip_reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutScorer:
    """The reward functions on sampled completions (``reward_fn(prompts, completions, answers, records)``): each
    call retried ``rollout_retries`` times, then on each completion alone, so only the completions it cannot score
    fail. A failed completion's reward is the mean of the others' (batch statistics and the normaliser keep their
    mean); a stage that cannot leave completions out (``drops_failed``: GRPO's can) stops with one line. A
    non-finite reward is zeroed and makes the steps on its rollout skip their update. DAPO's overlong shaping is
    added, and each reward function's mean and std are logged."""

    def __init__(self, config: OnlineRLConfig, reward_fn: RewardFn, decode: Callable[[list[int]], str], *,
                 drops_failed: bool = False) -> None:
        self.config, self.reward_fn, self.decode, self.drops_failed = config, reward_fn, decode, drops_failed

    @property
    def name(self) -> str:
        return getattr(self.reward_fn, "__name__", type(self.reward_fn).__name__)

    def score(self, episodes: Episodes, index: int, watch: Callable[[str], None]) -> Scores:
        """Scores of a rollout's episodes (rollout ``index``): the reward functions, plus an environment's (an
        agent's) rewards; an episode that failed in its environment counts as failed."""
        started = time.time()
        episodes_failed = torch.tensor(episodes.failed, dtype=torch.bool)
        if episodes_failed.numel() and episodes_failed.all():  # no fault of some episodes: nothing can train
            raise RolloutStopped(f"every episode of rollout {index} failed in its environment "
                                 f"({self.config.environment}; the warning above names the last error), so the run "
                                 f"stops: fix it, or raise rollout_retries / environment_timeout.")
        scores = self.score_completions(episodes.records, episodes.token_ids, watch, failed_already=episodes_failed)
        scores.failed = episodes_failed | scores.failed
        scores.metrics["rollout/failed_episodes"] = float(scores.failed.sum())
        if episodes.environment_rewards is not None:
            scores.rewards = scores.rewards + episodes.environment_rewards
            kept = ~scores.failed
            scores.metrics["reward"] = float(scores.rewards[kept].mean()) if kept.any() else 0.0
        scores.metrics["perf/scoring_s"] = time.time() - started
        return scores

    def score_completions(self, records: list[dict[str, Any]], completions: list[list[int]],
                          watch: Callable[[str], None], failed_already: torch.Tensor | None = None) -> Scores:
        """Raw rewards of the completions, logged per reward function. ``failed_already``: completions dropped before
        scoring (a failed episode), left out of the reward metrics."""
        config, metrics = self.config, {}
        texts = [self.decode(ids) for ids in completions]
        prompts = [r["messages"][-1]["content"] if r.get("messages") else "" for r in records]
        rewards, failed = self._rewards_or_failures(prompts, texts, [r.get("answer") for r in records], records,
                                                    watch)
        if failed.any() and not self.drops_failed:
            raise RLHFInputError(f"reward function {self.name} failed on {int(failed.sum())} completions after "
                                 f"{1 + config.rollout_retries} attempts each, and the {config.stage} stage cannot "
                                 f"leave completions out; fix it or raise rollout_retries")
        lost = failed | (failed_already if failed_already is not None else torch.zeros_like(failed))
        if lost.any():
            rewards = torch.where(lost, rewards[~lost].mean() if (~lost).any() else torch.tensor(0.0), rewards)
        if config.overlong_buffer_len:  # DAPO: long completions lose reward before they hit the limit
            shaping = overlong_penalty(torch.tensor([len(c) for c in completions]), config.max_completion_length,
                                       config.overlong_buffer_len, config.overlong_penalty_factor)
            rewards = rewards.to(torch.float32) + shaping
            metrics["rewards/overlong/mean"] = float(shaping.mean())
        components = getattr(self.reward_fn, "last_components", {})
        for name, values in components.items() if not failed.any() else ():  # one call's parts when none failed
            metrics[f"rewards/{name}/mean"] = float(values.mean())
            metrics[f"rewards/{name}/std"] = float(values.std()) if values.numel() > 1 else 0.0
        bad, skip_reason = ~torch.isfinite(rewards), ""
        if bad.any():
            skip_reason = f"reward ({int(bad.sum())} of {bad.numel()} completions)"
            rewards = torch.where(bad, torch.zeros_like(rewards), rewards)
        metrics["reward"] = float(rewards[~lost].mean()) if (~lost).any() else 0.0
        return Scores(rewards, failed, skip_reason, metrics)

    def _rewards_or_failures(self, prompts: list[str], texts: list[str], answers: list[Any],
                             records: list[dict[str, Any]],
                             watch: Callable[[str], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reward function on the batch, retried; if it still fails, on each completion alone (retried too).
        Returns the scores (0 where failed) and which failed; a reward function that fails on every completion
        stops the run with its own error."""
        attempts, n = 1 + self.config.rollout_retries, len(texts)
        watch(f"reward function {self.name}")
        scores, last = guarded_call(lambda: _call_reward(self.reward_fn, prompts, texts, answers, records), attempts)
        if last is None:
            return scores, torch.zeros(n, dtype=torch.bool)
        scores, failed = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
        for i in range(n):
            watch(f"reward function {self.name} (completion {i} alone)")
            alone = slice(i, i + 1)
            value, error = guarded_call(functools.partial(_call_reward, self.reward_fn, prompts[alone], texts[alone],
                                                          answers[alone], records[alone]), attempts)
            if error is None:
                scores[i] = value[0]
            else:
                failed[i], last = True, error
        if failed.all():  # a broken reward, not a fault of some calls: the run stops with its own error
            raise last
        if failed.any():
            logger.warning("reward function %s failed on %d of %d completions after %d attempts each (last error: "
                           "%s: %s); they are dropped", self.name, int(failed.sum()), n, attempts,
                           type(last).__name__, last)
        return scores, failed


# ---- Rows: a rollout's episodes as prompt + completion rows, and the engine's log-probs beside the trainer's ----


def rollout_rows(records: list[dict[str, Any]], completions: list[list[int]], pad_token_id: int,
                 masked: list[bool] | None = None, observed: list[list[bool]] | None = None) -> Rollout:
    """Prompt + completion rows; ``masked`` rows and ``observed`` completion tokens (an environment's) get no label,
    so no loss, KL or advantage term ever covers them."""
    rows = [_prompt_completion(r["prompt_ids"], c) for r, c in zip(records, completions)]
    if observed is not None:
        rows = [(ids, labels[:len(labels) - len(seen)] + [IGNORE_INDEX if o else t for t, o in
                                                         zip(labels[len(labels) - len(seen):], seen)])
                for (ids, labels), seen in zip(rows, observed)]
    if masked is not None:
        rows = [(ids, [IGNORE_INDEX] * len(ids)) if drop else (ids, labels)
                for (ids, labels), drop in zip(rows, masked)]
    batch = _pad_rows([r[0] for r in rows], [r[1] for r in rows], pad_token_id)
    images = [r.get("images") or [] for r in records]
    return Rollout(batch["input_ids"], batch["attention_mask"], batch["labels"],
                   prompt_lengths=torch.tensor([len(r["prompt_ids"]) for r in records], dtype=torch.long),
                   images=images if any(images) else None)


def per_call_rows(episodes: Episodes, masked: list[bool] | None, advantages: torch.Tensor,
                  pad_token_id: int) -> tuple[Rollout, Episodes]:
    """``agent_trajectory: per_call``: every request of an agent's episode a row of its own (its prompt as the agent
    sent it, its answer as sampled), each with its episode's advantage; a dropped episode keeps one masked row.
    Returns the rollout of those rows and their Episodes (the recorded log-probs)."""
    rows, completions, logps, reasons, dropped, row_advantages = [], [], [], [], [], []
    for episode, (record, calls) in enumerate(zip(episodes.records, episodes.calls)):
        for prompt_ids, ids, lps, reason in calls or [(record["prompt_ids"], [], [], "stop")]:
            rows.append({**record, "prompt_ids": list(prompt_ids)})
            completions.append(list(ids))
            logps.append(list(lps))
            reasons.append(reason)
            dropped.append(bool(masked and masked[episode]) or not calls)
            row_advantages.append(float(advantages[episode]))
    rollout = rollout_rows(rows, completions, pad_token_id, dropped)
    rollout.advantages = torch.tensor(row_advantages, dtype=torch.float32)
    row_episodes = Episodes(completions, logps, reasons, rows, policy_version=episodes.policy_version,
                            metrics={"tools/trained_rows": float(len(rows))})
    return rollout, row_episodes


def engine_log_probs(rollout: Rollout, episodes: Episodes) -> torch.Tensor:
    """The engine's log-prob of each sampled token, aligned with the rollout's shifted labels. Shapes: -> (N, T-1)."""
    logps = torch.zeros(rollout.labels.shape[0], rollout.labels.shape[1] - 1)
    for row, (start, values) in enumerate(zip(rollout.prompt_lengths.tolist(), episodes.logprobs)):
        logps[row, start - 1:start - 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
    return logps


def engine_correction(config: OnlineRLConfig, rollout: Rollout, episodes: Episodes,
                      trainer_sampled: torch.Tensor | None) -> dict[str, float]:
    """An engine holding a copy of the policy (vLLM, a low-precision copy) sampled the rollout: its log-probs become
    the old ones (vllm_old_logprobs: engine), or set the importance weights that correct the engine/trainer
    mismatch (Yao et al. 2025; ``trainer_sampled``: the trainer's log-probs under the distribution the engine
    sampled from, OutputHead.sampled_log_probs). Returns the mismatch's metrics."""
    engine = engine_log_probs(rollout, episodes)
    if config.vllm_old_logprobs == "engine":
        rollout.old_logps = engine
        return {}
    weights, metrics = rollout_importance_weights(trainer_sampled, engine, rollout.completion_mask,
                                                  cap=config.vllm_importance_sampling_cap,
                                                  mode=config.vllm_importance_sampling_mode)
    if config.vllm_importance_sampling_correction:
        rollout.importance_weights = weights
        return metrics
    return {k: v for k, v in metrics.items() if not k.startswith("is_")}


# ---- Rollouts in checkpoints: a checkpoint taken inside a rollout keeps it, so a resume trains on the same rows ----


def rollout_file(process: int) -> str:
    return "rollout.safetensors" if process == 0 else f"rollout-{process}.safetensors"


def save_rollouts(directory: Path, rollouts: list[Rollout]) -> None:
    """Every process's current rollout (process i's in rollout_file(i)), tensors and metadata in safetensors."""
    for process, rollout in enumerate(rollouts):
        save_file({k: v.contiguous() for k, v in rollout.tensors().items()}, str(directory / rollout_file(process)),
                  metadata={"skip_reason": rollout.skip_reason, "processes": str(len(rollouts)),
                            "images": json.dumps(rollout.images)})


def episodes_to_json(episodes: Episodes) -> dict[str, Any]:
    """Episodes as JSON (token ids, log-probs as floats written exactly, records, masks, versions): a checkpoint's
    rollouts sampled ahead."""
    rewards = episodes.environment_rewards
    return {**{f.name: getattr(episodes, f.name) for f in dataclasses.fields(episodes)},
            "environment_rewards": rewards.tolist() if rewards is not None else None}


def episodes_from_json(data: dict[str, Any]) -> Episodes:
    rewards = data.get("environment_rewards")
    calls = data.get("calls")
    return Episodes(**{**data, "environment_rewards": torch.tensor(rewards, dtype=torch.float32) if rewards is not None
                       else None, "calls": [[tuple(call) for call in episode] for episode in calls]
                       if calls is not None else None})


def buffer_file(process: int) -> str:
    return "rollout_buffer.json" if process == 0 else f"rollout_buffer-{process}.json"


def save_buffers(directory: Path, buffers: list[dict[str, Any]]) -> None:
    """Every process's rollouts sampled ahead (``buffers[i]``: {rollouts: [[prompt ids, episodes JSON]], dropped}),
    process i's in buffer_file(i); nothing when no process holds any."""
    if not any(buffer["rollouts"] for buffer in buffers):
        return
    for process, buffer in enumerate(buffers):
        (directory / buffer_file(process)).write_text(json.dumps({**buffer, "processes": len(buffers)}),
                                                      encoding="utf-8")


def load_buffer(directory: Path, process: int, processes: int) -> tuple[list[tuple[list, Episodes]], int] | None:
    """This process's rollouts sampled ahead from a checkpoint and the stale completions dropped so far, or None
    when it holds none (or was written by another number of processes: they are sampled again, with a warning)."""
    path = directory / buffer_file(process)
    if not path.exists():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("processes") != processes:
        logger.warning("%s holds the rollouts sampled ahead by %s process(es) and this run has %d: they are sampled "
                       "again", directory, data.get("processes"), processes)
        return None
    return [(ids, episodes_from_json(episodes)) for ids, episodes in data["rollouts"]], int(data.get("dropped", 0))


class RolloutLedger:
    """Which prompts every trained rollout sampled: ``rollouts.jsonl`` in output_dir, a line per rollout with its
    index, the optimizer step that first trained on it and every process's prompt positions in the prompt set (None
    when streaming). A resumed run drops the lines of the rollouts after its checkpoint before it goes on, so the
    file of a finished run lists what it trained on, each prompt as often as an uninterrupted run would."""

    FILE = "rollouts.jsonl"

    def __init__(self, directory: Path, keep_below: int, write: bool = True) -> None:
        self.path, self.write = directory / self.FILE, write
        if not write:
            return
        directory.mkdir(parents=True, exist_ok=True)
        kept = [line for line in (self.path.read_text(encoding="utf-8").splitlines() if self.path.exists() else [])
                if line.strip() and json.loads(line)["rollout"] < keep_below]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def record(self, index: int, step: int, positions: list[list[int] | None]) -> None:
        if self.write:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"rollout": index, "step": step, "prompts": positions}) + "\n")

    @staticmethod
    def read(directory: Path) -> list[dict[str, Any]]:
        path = directory / RolloutLedger.FILE
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_rollout(directory: Path, process: int, processes: int) -> Rollout | None:
    """This process's rollout from a checkpoint, or None (with a warning) when the checkpoint was written by another
    number of processes (the interrupted rollout is then sampled again)."""
    first = directory / rollout_file(0)
    if not first.exists():
        return None
    with safe_open(str(first), framework="pt") as handle:
        written = int((handle.metadata() or {}).get("processes", "1"))
    if written != processes:  # every process reads the same file, so all agree
        logger.warning("%s holds the rollouts of %d process(es) and this run has %d: the interrupted rollout is "
                       "sampled again", directory, written, processes)
        return None
    with safe_open(str(directory / rollout_file(process)), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        metadata = handle.metadata() or {}
    return Rollout(**tensors, skip_reason=metadata.get("skip_reason", metadata.get("problem", "")),
                   images=json.loads(metadata.get("images", "null")))



# ==== 10. Trainers ====


# ---- The training loop every stage shares: BaseTrainer ----


def close_loss_scaler_step(scaler: Any) -> None:
    """An fp16 step whose gradients were unscaled for clipping but whose update is skipped must still
    close the loss scaler's step; otherwise the next ``unscale_`` fails ("already been called on this
    optimizer since the last update")."""
    try:
        scaler.update()
    except AssertionError:  # nothing was unscaled this step (no clipping), so there is nothing to close
        pass


class TrainingDivergedError(RLHFInputError):
    """Too many steps in a row produced a non-finite loss, reward or gradient; a checkpoint was saved."""


@dataclass
class TrainResult:
    """What a stage reports: final metrics, evaluation (before and after), and where outputs went."""

    stage: str
    output_dir: Path
    global_step: int
    seconds: float
    metrics: dict[str, float]
    eval: dict[str, float]
    eval_before: dict[str, float] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False

    def report_entry(self) -> dict[str, Any]:
        entry = {"stage": self.stage, "seconds": round(self.seconds, 2), "global_step": self.global_step,
                 "output_dir": str(self.output_dir), "metrics": self.metrics, "eval": self.eval}
        if self.eval_before is not None:
            entry["eval_before"] = self.eval_before
        if self.stopped_early:
            entry["stopped_early"] = True
        return entry


class RouterAuxLoss:
    """The router load-balancing loss of a mixture-of-experts model's training forwards, for the trainer to add
    to its loss (``router_load_balancing_loss``, the Switch Transformer / Mixtral / Qwen3-MoE formula). Hooks on
    each MoE block's router keep its logits while a grad-enabled forward of the decoder runs, and the decoder's
    hooks turn them into one loss per forward with its padding left out. The model's own ``output_router_logits``
    stays off: its causal-LM head would compute the loss again and cannot read the packed and tree attention masks
    the preference and online-RL trainers use. Forwards without gradients (rollouts, the reference, evaluation)
    and gradient checkpointing's recomputation in backward are left out."""

    def __init__(self, decoders: list[nn.Module], routers: list[nn.Module], coef: float, top_k: int) -> None:
        self.coef, self.top_k = coef, top_k
        self.losses: list[torch.Tensor] = []
        self._logits: list[torch.Tensor] | None = None  # the running forward's, or None outside one
        self._mask: torch.Tensor | None = None
        for decoder in decoders:
            decoder.register_forward_pre_hook(self._start, with_kwargs=True)
            decoder.register_forward_hook(self._finish)
        for router in routers:
            router.register_forward_hook(self._keep)

    @classmethod
    def attach(cls, model: nn.Module, config: BaseConfig) -> RouterAuxLoss | None:
        """None unless ``model`` holds a mixture-of-experts model and the coefficient (``router_aux_loss_coef``,
        default the model's own) is not 0."""
        from transformers import PreTrainedModel

        routers = [m.gate for m in model.modules()
                   if hasattr(m, "experts") and isinstance(getattr(m, "gate", None), nn.Module)]
        if not routers:
            return None
        # each router's decoder: the innermost Hugging Face model holding it (a PPO critic may be another model)
        owners = [min((m for m in model.modules() if isinstance(m, PreTrainedModel)
                       and any(r is router for r in m.modules())), key=lambda m: sum(1 for _ in m.modules()))
                  for router in routers]
        decoders = list({id(m): m for m in owners}.values())
        coef = config.router_aux_loss_coef
        coef = float(getattr(decoders[0].config, "router_aux_loss_coef", 0.0) if coef is None else coef)
        if coef == 0.0:
            return None
        top_k = int(getattr(routers[0], "top_k", getattr(decoders[0].config, "num_experts_per_tok", 2)))
        logger.info("mixture of experts: router load-balancing loss x %g added to the loss (moe/aux_loss)", coef)
        return cls(decoders, routers, coef, top_k)

    def _start(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if torch.is_grad_enabled():
            mask = kwargs.get("attention_mask")
            self._logits, self._mask = [], mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _keep(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._logits is not None and torch.is_grad_enabled():
            self._logits.append(output[0] if isinstance(output, tuple) else output)

    def _finish(self, module: nn.Module, args: tuple, output: Any) -> None:
        logits, mask, self._logits = self._logits, self._mask, None
        if logits:
            fits = mask is not None and mask.numel() == logits[0].shape[0]  # packed rows carry no (B, T) mask
            self.losses.append(router_load_balancing_loss(logits, self.top_k, mask if fits else None))


def _format_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


@dataclass
class _LogWindow:
    """What this process's optimizer steps measured since the last log line: the summed loss and its units, the
    tokens, and each micro-batch's metrics."""

    loss: float = 0.0
    units: float = 0.0
    tokens: int = 0  # processed: every token of every sequence, padding left out
    trained: int = 0  # with a label (the loss's tokens)
    flops: float = 0.0  # the model FLOPs of the forward and backward passes (ModelShape.training_flops)
    steps: int = 0
    batch_s: float = 0.0  # waiting for batches (an online stage's rollouts: sampling, scoring, reference passes)
    train_s: float = 0.0  # the optimizer steps' forward, backward and update
    since: float = field(default_factory=time.time)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    shape: ModelShape | None = None  # the policy's, for its FLOPs
    peak: float | None = None  # the FLOP/s of one process's device that perf/mfu is measured against

    @classmethod
    def for_model(cls, model: nn.Module, config: BaseConfig, device: torch.device) -> _LogWindow:
        """A window that counts ``model``'s FLOPs against the peak: mfu_peak_flops, a known GPU's, or this CPU's
        measured rate."""
        try:
            shape = ModelShape.of(model)
        except (AttributeError, TypeError):  # a model without a transformers config: no FLOP count
            shape = None
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision,
                                                                       next(model.parameters()).dtype)
        return cls(shape=shape, peak=config.mfu_peak_flops or device_peak_flops(
            device, compute, Path(config.cache_dir or _default_cache_dir())))

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the seconds of the block to ``part`` (batch_s: waiting for a step's batches; train_s: the step)."""
        started = time.perf_counter()
        yield
        setattr(self, part, getattr(self, part) + time.perf_counter() - started)
        self.steps += part == "train_s"

    def add(self, batch: dict[str, torch.Tensor], metrics: dict[str, float]) -> None:
        """One micro-batch's tokens, FLOPs and metrics (its loss comes with the step's, once the step updates)."""
        rows = batch.get("attention_mask", batch["input_ids"])
        rows = rows.reshape(-1, rows.shape[-1])
        lengths = rows.sum(-1).tolist() if "attention_mask" in batch else [rows.shape[-1]] * rows.shape[0]
        self.tokens += int(sum(lengths))
        labels = batch.get("labels")
        self.trained += int((labels != IGNORE_INDEX).sum()) if isinstance(labels, torch.Tensor) else int(sum(lengths))
        if self.shape is not None:
            self.flops += self.shape.training_flops(int(n) for n in lengths)
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append(value)

    def totals(self, devices: DeviceManager) -> tuple[float, dict[str, float]]:
        """(loss, metrics) of all processes together, as one process would log them: the loss summed over every
        process's micro-batches over the units of all of them, each metric averaged over every micro-batch, and the
        throughput (processed and trained tokens per second, MFU against ``peak`` per process, seconds per step
        waiting for batches and training). A collective: every process calls it."""
        elapsed = max(time.time() - self.since, 1e-9)
        loss, units, tokens, trained, flops = devices.sum_list_across_processes(
            [self.loss, self.units, self.tokens, self.trained, self.flops])
        metrics: dict[str, list[float]] = {}
        for part in devices.gather_object(self.metrics):
            for key, values in part.items():
                metrics.setdefault(key, []).extend(values)
        perf = {"perf/tokens_per_s": tokens / elapsed, "perf/trained_tokens_per_s": trained / elapsed}
        if self.steps:
            perf.update({"perf/batch_s": self.batch_s / self.steps, "perf/training_s": self.train_s / self.steps})
        if self.peak and flops:
            perf["perf/mfu"] = flops / elapsed / (self.peak * devices.num_processes)
        return loss / max(units, 1.0), {**{k: float(np.mean(v)) for k, v in metrics.items()}, **perf}

    def reset(self) -> None:
        self.loss, self.units, self.tokens, self.trained, self.flops = 0.0, 0.0, 0, 0, 0.0
        self.steps, self.batch_s, self.train_s, self.since, self.metrics = 0, 0.0, 0.0, time.time(), {}


class BaseTrainer(CheckpointingMixin):
    """One training loop for every stage: accumulation with the loss normalised over all accumulated
    micro-batches, clipping, scheduling, evaluation, atomic checkpoints, exact resume, early
    stopping and logging. Subclasses supply ``compute_loss`` and ``loss_units`` (and ``evaluate``)."""

    stage = "base"

    def __init__(self, config: BaseConfig, policy: PolicyModel, train_dataset: Any, *, eval_dataset: Any = None,
                 devices: DeviceManager | None = None, collator: Callable | None = None) -> None:
        self.config = config
        if self.stage in STAGES:  # a registered stage's trainer carries its TrainingStage (a custom one its name)
            self.stage = TrainingStage(self.stage)
        self.policy = policy
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.output_dir = Path(config.output_dir)
        self.collator = collator or SFTCollator(policy.tokenizer.pad_token_id, vision=policy.vision)
        self.global_step = 0
        self.micro_batches_done = 0
        self.nonfinite_in_a_row, self.skipped_steps = 0, 0
        self.pending_problem = ""  # set by a subclass (e.g. non-finite rewards) to skip the next update
        self.step_metrics: dict[str, float] = {}  # set by make_batches (a rollout's metrics): logged with the next step
        self.last_problem = ""
        self.ewc: ElasticWeightConsolidation | None = None  # set up in train(), before resuming moves the weights
        self._setup_devices(devices)
        self._setup_model()
        self.router_loss = RouterAuxLoss.attach(self.devices.unwrap(self.model), config)
        self._setup_schedule()
        self._setup_optimizer()
        self._after_prepare()
        self.checkpoints = CheckpointManager(self.output_dir, config.save_total_limit, sweep=False)  # train() sweeps
        self.early_stopping = None
        if config.early_stopping_patience:
            mode = "max" if "accuracy" in config.metric_for_best_model else "min"
            self.early_stopping = EarlyStopping(config.early_stopping_patience, mode=mode)

    # -- subclass interface
    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss SUMMED over the batch's loss units, and metrics to log."""
        raise NotImplementedError

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        """What the loss is averaged over (target tokens for SFT), counted before the forward pass."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        return {}

    def _eval_share(self, dataset: Any) -> Iterator[tuple[list[dict[str, Any]], bool]]:
        """This process's held-out batches as (items, keep): every batch on one process, every num_processes-th
        one on several, in lockstep (``DeviceManager.lockstep_share``); the caller sums its kept results across
        processes, so each process evaluates 1 / num_processes of the set and all of them report the whole."""
        size = self.config.per_device_eval_batch_size
        starts = range(0, len(dataset), size)
        for index, keep in self.devices.lockstep_share(len(starts)):
            yield [dataset[i] for i in range(starts[index], min(starts[index] + size, len(dataset)))], keep

    # -- setup
    def _setup_devices(self, devices: DeviceManager | None) -> None:
        self.devices = devices or DeviceManager(self.config.mixed_precision, self.config.report_to,
                                                self.output_dir / "runs", self.config.ddp_timeout)

    def _setup_model(self) -> None:
        self.policy.prepare_for_training(self.config)
        self.policy.model.to(self.devices.device)
        self.policy.model = compile_training_step(self.policy.model, self.config.torch_compile)
        self.model = self._prepared(self.policy.model)

    def _prepared(self, module: nn.Module) -> nn.Module:
        """``module`` prepared for training by accelerate (DDP / FSDP wrap it here). Under DeepSpeed it is returned
        as it is, and prepared in ``_setup_optimizer``: DeepSpeed makes a model and its optimizer one engine, in one
        call."""
        return module if self.devices.uses_deepspeed else self.devices.prepare(module)

    def _after_prepare(self) -> None:
        """Once model and optimizer are prepared: sharding, train mode, and the prepared view training forwards use."""
        self._setup_sharding()
        self.model.train()
        self.train_policy = self._prepared_view()

    def _setup_sharding(self) -> None:
        """After ``prepare``: with weights sharded across processes (FSDP2, ZeRO-3) every forward of the policy is a
        collective, so generation runs in lockstep (``synced``) and saving gathers the weights first."""
        self.sharded = bool(self.devices.check_sharding(self.model))

    def _generating(self) -> contextlib.AbstractContextManager:
        """Around a generation with the unwrapped policy: what a sharded model needs first
        (``DeviceManager.generating_with``); nothing otherwise."""
        if not self.sharded:
            return contextlib.nullcontext()
        return self.devices.generating_with(self.model, self.devices.unwrap(self.policy.model))

    def _prepared_view(self) -> nn.Module:
        """``self.policy`` with its module swapped for the prepared one (DDP / FSDP / DeepSpeed), for the
        forwards that build a graph to train on. DDP all-reduces gradients only in backwards of forwards it
        ran itself (its forward arms the reducer's parameter hooks), and FSDP / DeepSpeed gather sharded
        weights there: a forward through ``self.policy.model`` trains each process on its own gradients.
        Generation, the LoRA reference (``disable_adapter``), no-grad evaluation and saving keep using the
        unwrapped ``self.policy``, so they never run a collective and work on one process alone."""
        if self.model is self.policy.model:  # one process: prepare returned the module itself
            return self.policy
        view = copy.copy(self.policy)  # shallow: same tokenizer and settings, its own module table
        view._modules = {**self.policy._modules, "model": self.model}
        return view

    @property
    def forward_policy(self) -> nn.Module:
        """The policy a forward should use: the prepared view when autograd records (training), else the
        unwrapped policy (no-grad forwards need no gradient sync, and skip DDP's buffer broadcast)."""
        return self.train_policy if torch.is_grad_enabled() else self.policy

    def _setup_schedule(self) -> None:
        config = self.config
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            self.sampler = None
            self.total_steps = config.max_steps
            return
        if len(self.train_dataset) == 0:
            raise RLHFInputError("the training set is empty after preprocessing")
        lengths = (self.train_dataset.lengths() if config.group_by_length and hasattr(self.train_dataset, "lengths")
                   else None)
        self.sampler = ResumableBatchSampler(len(self.train_dataset), config.per_device_train_batch_size, config.seed,
                                             rank=self.devices.process_index, world_size=self.devices.num_processes,
                                             lengths=lengths)
        micro_batches = math.ceil(config.num_train_epochs * self.sampler.batches_per_epoch)
        self.total_steps = config.max_steps if config.max_steps > 0 else max(1, math.ceil(
            micro_batches / config.gradient_accumulation_steps))

    def _setup_optimizer(self) -> None:
        optimizer, self.scheduler = create_optimizer(self.model, self.config, self.total_steps)
        if self.devices.uses_deepspeed:
            self.model, self.optimizer = self.devices.prepare_engine(self.model, optimizer, self.config)
        else:
            self.optimizer = self.devices.prepare(optimizer)

    # -- data
    def make_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches from the current position to forever (the loop decides when to stop). Online
        trainers override it to sample rollouts and cut them into micro-batches."""
        if self.sampler is None:
            yield from self._streaming_batches()
            return
        self.sampler.start = self.micro_batches_done
        # its own generator: a DataLoader iterator otherwise draws a seed from torch's global RNG, which a
        # resumed run restores only after that draw would have happened
        loader = torch.utils.data.DataLoader(self.train_dataset, batch_sampler=self.sampler, collate_fn=self.collator,
                                             num_workers=self.config.dataloader_num_workers,
                                             generator=torch.Generator().manual_seed(self.config.seed))
        yield from loader

    def _streaming_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        dataset, size = self.train_dataset, self.config.per_device_train_batch_size
        while True:
            pending = []
            for item in dataset:
                pending.append(item)
                if len(pending) == size:
                    yield self.collator(pending)
                    pending = []
            if pending:
                yield self.collator(pending)
            if dataset.stats["records"] == 0:
                raise RLHFInputError("the streaming dataset yielded no records")
            dataset.set_epoch(dataset.epoch + 1)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.devices.device) for k, v in batch.items()}

    # -- the loop
    def train(self) -> TrainResult:
        self.preemption = PreemptionGuard()
        # the main process holds the folder (its stage runner may hold it already, and then lets go of it itself)
        with RunFolderLock.for_run(self.output_dir, take=self.devices.is_main_process):
            if self.devices.is_main_process:
                self.checkpoints.sweep()
            try:
                with self.preemption:
                    return self._train()
            except TrainingPreempted:
                raise
            except KeyboardInterrupt as interrupt:
                progress = getattr(getattr(self, "training_logger", None), "_progress", None)
                if progress is not None:
                    progress.stop()
                raise TrainingInterrupted(self._resume_advice()) from interrupt

    def _preempted(self) -> bool:
        """Whether a stop signal reached any process (all of them then stop after the same step, so their
        collective checkpoint stays in step: one small all-reduce per step when there are several)."""
        guard = getattr(self, "preemption", None)
        local = guard is not None and guard.received is not None
        if self.devices.num_processes > 1:
            return self.devices.sum_across_processes(float(local)) > 0
        return local

    def _stop_for_preemption(self) -> None:
        self.training_logger.close()
        received = self.preemption.received
        by = received.name if received is not None else "a stop signal to another process"
        raise TrainingPreempted(f"stopped by {by} after step {self.global_step} of {self.total_steps}, with a "
                                f"checkpoint: " + self._resume_advice().removeprefix("interrupted: "),
                                int(received or signal.SIGTERM))

    def _train(self) -> TrainResult:
        started = time.time()
        self.ewc = ElasticWeightConsolidation.for_stage(self.config, self.policy, self.model, self.devices,
                                                        self.output_dir)
        self._resume()
        config = self.config
        eval_before = None
        if config.eval_before_training and self.global_step == 0:
            eval_before = self.evaluate()
            logger.info("before training: %s", _format_metrics(eval_before))
        self.training_logger = TrainingLogger(self.output_dir, self.total_steps, self.devices, config,
                                              description=self.stage, start_step=self.global_step)
        batches = self.make_batches()
        resumed_at = self.global_step
        window = _LogWindow.for_model(getattr(self.policy, "model", self.model), config, self.devices.device)
        stopped_early, last_eval = False, {}
        while self.global_step < self.total_steps:
            with window.timed("batch_s"):
                group = [next(batches) for _ in range(config.gradient_accumulation_steps)]
            with window.timed("train_s"):
                step_metrics = self._optimizer_step(group, window)
            self.global_step += 1
            self.micro_batches_done += len(group)
            self._stop_if_diverged()
            final = self.global_step == self.total_steps
            if self.global_step % config.logging_steps == 0 or final:
                self._log_window(window, step_metrics)
            self.training_logger.advance()  # after the log, so that a progress line shows this step's loss
            if (config.eval_steps and self.global_step % config.eval_steps == 0) or final:
                last_eval = self.evaluate()
                if last_eval:
                    self.training_logger.log(self.global_step, last_eval)
                stopped_early = self._should_stop(last_eval)
            saving = (config.save_steps and self.global_step % config.save_steps == 0) or final or stopped_early
            if saving:
                self._save_checkpoint()
            if not final and self._preempted():
                if not saving:
                    self._save_checkpoint()
                self._stop_for_preemption()
            if stopped_early:
                logger.info("early stopping at step %d: %s did not improve for %d evaluations", self.global_step,
                            config.metric_for_best_model, config.early_stopping_patience)
                break
        if self.global_step == resumed_at and self.global_step > 0:  # finished earlier: report its evaluation
            logger.info("already trained to step %d (checkpoint); evaluating only", self.global_step)
            last_eval = self.evaluate()
        self.training_logger.close()
        self._save_final_model()
        seconds = time.time() - started
        history = self.training_logger.history
        train_losses = [row["loss"] for row in history if "loss" in row]
        metrics = {"train_loss": float(np.mean(train_losses)) if train_losses else float("nan"),
                   "final_loss": train_losses[-1] if train_losses else float("nan"),
                   "steps": self.global_step, **self._data_stats()}
        if self.skipped_steps:
            metrics["stability/skipped_steps"] = self.skipped_steps
        return TrainResult(self.stage, self.output_dir, self.global_step, seconds, metrics, last_eval, eval_before,
                           history, stopped_early)

    def _optimizer_step(self, group: list[dict[str, torch.Tensor]], window: _LogWindow) -> dict[str, float]:
        """Accumulate gradients over ``group`` and take one optimizer step.

        Every micro-batch's summed loss is divided by the loss units of the whole group (across all
        processes), so the gradient is exactly the gradient of the mean over the group.
        """
        units = self.devices.sum_across_processes(sum(self.loss_units(b) for b in group))
        scale = self.devices.num_processes / max(units, 1.0)  # DDP averages gradients over processes
        losses = []
        for i, batch in enumerate(group):
            batch = self._to_device(batch)
            if self.router_loss is not None:
                self.router_loss.losses.clear()
            with self.devices.no_sync(self.model, skip=i < len(group) - 1), self.devices.autocast():
                loss_sum, metrics = self.compute_loss(batch)
            if i == 0 and self.step_metrics:
                metrics, self.step_metrics = {**metrics, **self.step_metrics}, {}
            objective = loss_sum * scale
            if self.router_loss is not None and self.router_loss.losses:  # the step's mean, one share per micro-batch
                aux = torch.stack(self.router_loss.losses).mean()
                objective = objective + self.router_loss.coef * aux / len(group)
                metrics = {**metrics, "moe/aux_loss": float(aux.detach())}
            if self.ewc is not None and i == len(group) - 1:  # once per step; identical on every process
                penalty = self.ewc.penalty(self.devices.unwrap(self.model))
                objective = objective + penalty
                metrics = {**metrics, "ewc/penalty": float(penalty.detach())}
            self.devices.backward(objective)  # every process runs backward, so collectives stay in step
            losses.append(float(loss_sum.detach()))
            window.add(batch, metrics)
        deepspeed_steps = self.devices.uses_deepspeed  # DeepSpeed clips (gradient_clipping) and steps in its own step
        grad_norm = 0.0 if deepspeed_steps else self.devices.clip_grad_norm(self.model.parameters(),
                                                                         self.config.max_grad_norm)
        problem = self._nonfinite_problem(losses, grad_norm)
        if not problem and deepspeed_steps:
            grad_norm = self.devices.deepspeed_step()  # inf: DeepSpeed found it non-finite and did not update
            if not math.isfinite(grad_norm) and self.config.mixed_precision != "fp16":
                problem = "gradient norm"
        if problem:
            self._skip_update(problem)
            return {"grad_norm": grad_norm, "stability/skipped_steps": 1.0}
        self.nonfinite_in_a_row = 0
        window.loss += sum(losses)
        window.units += units / self.devices.num_processes
        if not deepspeed_steps:
            self.optimizer.step()
        self.scheduler.step()
        self.devices.zero_grad(self.optimizer)
        return {"grad_norm": grad_norm}

    # -- stability
    def _nonfinite_problem(self, losses: list[float], grad_norm: float) -> str:
        """Why this step must not update the weights ('' if it may), agreed by every process."""
        reasons = []
        if not all(math.isfinite(value) for value in losses):
            reasons.append("loss")
        # fp16 overflow is the loss scaler's business (it skips the step and lowers the scale)
        if not math.isfinite(grad_norm) and self.config.mixed_precision != "fp16":
            reasons.append("gradient norm")
        if self.pending_problem:
            reasons.append(self.pending_problem)
        self.pending_problem = ""
        if self.devices.sum_across_processes(float(bool(reasons))) > 0 and not reasons:
            reasons.append("another process")
        return " and ".join(reasons)

    def _skip_update(self, problem: str) -> None:
        """Drop this step's gradients (the schedule still advances, so the learning rate follows
        global_step, as a weights-only resume assumes); after max_nonfinite_steps in a row, checkpoint and stop."""
        self.devices.zero_grad(self.optimizer)
        with warnings.catch_warnings():  # torch warns when the schedule steps before the first optimizer step
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()
        scaler = getattr(getattr(self.devices, "accelerator", None), "scaler", None)
        if scaler is not None:
            close_loss_scaler_step(scaler)
        self.nonfinite_in_a_row += 1
        self.skipped_steps += 1
        logger.warning("step %d: non-finite %s; update skipped (%d in a row)", self.global_step + 1, problem,
                       self.nonfinite_in_a_row)
        self.last_problem = problem

    def _stop_if_diverged(self) -> None:
        if self.nonfinite_in_a_row < self.config.max_nonfinite_steps:
            return
        self._save_checkpoint()  # the weights are the last good ones: every bad update was skipped
        raise TrainingDivergedError(
            f"{self.nonfinite_in_a_row} steps in a row had a non-finite {self.last_problem} (last at step "
            f"{self.global_step}); stopped after saving {self.checkpoints.latest()}. Lower learning_rate, set "
            f"max_grad_norm, or check the reward functions, then run again to resume")

    def _log_window(self, window: _LogWindow, step_metrics: dict[str, float]) -> None:
        loss, metrics = window.totals(self.devices)
        row = {"loss": loss, **step_metrics, "learning_rate": self.scheduler.get_last_lr()[0], "epoch": self._epoch(),
               **metrics}
        self.training_logger.log(self.global_step, row)
        window.reset()

    def _epoch(self) -> float:
        if self.sampler is None:
            return float(getattr(self.train_dataset, "epoch", 0))
        return self.micro_batches_done / self.sampler.batches_per_epoch

    def _should_stop(self, evaluation: dict[str, float]) -> bool:
        if self.early_stopping is None:
            return False
        if self.config.metric_for_best_model not in evaluation:
            raise RLHFInputError(f"config field 'metric_for_best_model' is '{self.config.metric_for_best_model}', "
                                 f"but evaluation reports only: {', '.join(evaluation) or 'nothing (add eval data)'}")
        return self.early_stopping.step(evaluation[self.config.metric_for_best_model])

    def _data_stats(self) -> dict[str, float]:
        stats = getattr(self.train_dataset, "stats", {})
        return {f"data/{k}": v for k, v in stats.items()}

    # -- the model a checkpoint holds (saving and resuming it: CheckpointingMixin, section 2)
    policy_prefix = ""  # where the policy's weights sit in the prepared module's state dict
    sharded = False  # set by _setup_sharding once the model is prepared

    def _save_model(self, directory: Path) -> None:
        """The trained model in Hugging Face layout (subclasses with other models override); a sharded model's
        weights come from ``gathered_weights``. It carries the chat template it was trained with and its stop
        tokens (``saved_as_trained``)."""
        model = self.devices.unwrap(self.policy.model)
        with saved_as_trained(model, self.policy.tokenizer, getattr(self, "formatter", None)):
            PolicyModel(model, self.policy.tokenizer, vision=self.policy.vision).save_pretrained(
                directory, state_under(self.gathered_weights, self.policy_prefix))

    def _load_model(self, directory: Path) -> None:
        load_weights_into(self.devices.unwrap(self.policy.model), directory)


# ---- Shared by the policy trainers: held-out exact-match accuracy ----


def _exact_match_counts(policy: PolicyModel, formatter: ChatFormatter, records: list[dict[str, Any]],
                        max_new_tokens: int, batch_size: int, *, filler: Sequence[dict[str, Any]] = (),
                        synced: bool = False) -> list[float]:
    """(correct answers, answers with the Answer: line, completion tokens) over ``records``; the ``filler``
    prompts are answered too (lockstep) and not counted."""
    prompts = [*records, *filler]
    completions = policy.generate([formatter.prompt_ids(r) for r in prompts], max_new_tokens=max_new_tokens,
                                  stop_token_ids=formatter.stop_token_ids, batch_size=batch_size, synced=synced,
                                  images=[r.get("images") or [] for r in prompts])[:len(records)]
    return _exact_match_tally(policy, records, completions)


def _exact_match_tally(policy: PolicyModel, records: list[dict[str, Any]], completions: list[list[int]]) -> list[float]:
    """(correct answers, answers with the Answer: line, completion tokens) of the completions of ``records``."""
    answers = [extract_answer(policy.decode(ids)) for ids in completions]
    correct = sum(a is not None and a == r["answer"].strip() for a, r in zip(answers, records))
    return [float(correct), float(sum(a is not None for a in answers)), float(sum(len(c) for c in completions))]


def evaluate_exact_match(policy: PolicyModel, formatter: ChatFormatter, records: list[dict[str, Any]], *,
                         max_new_tokens: int = 64, batch_size: int = 32,
                         devices: DeviceManager | None = None, synced: bool = False) -> dict[str, float]:
    """Greedy answers to prompts with a known ``answer``: exact-match accuracy and how often the
    response had the ``Answer:`` line at all (format rate). With ``devices`` every process answers
    every num_processes-th prompt and the counts are summed, so all processes return the figures of
    the whole set (call it on every process; ``policy`` is the unwrapped model). ``synced``: its
    weights are sharded across the processes (FSDP2, ZeRO-3), so every forward is a collective: each
    process then answers as many prompts, a shorter share topped up with repeats that are not counted,
    and decodes in lockstep."""
    scored = [r for r in records if r.get("answer") is not None]
    if not scored:
        return {}
    if devices is not None and devices.num_processes > 1:
        mine = scored[devices.process_index::devices.num_processes]
        share = math.ceil(len(scored) / devices.num_processes)
        filler = [mine[-1] if mine else scored[0]] * (share - len(mine)) if synced else []
        counts = (_exact_match_counts(policy, formatter, mine, max_new_tokens, batch_size, filler=filler, synced=synced)
                  if mine or filler else [0.0] * 3)
        correct, formatted, tokens = devices.sum_list_across_processes(counts)
    else:
        correct, formatted, tokens = _exact_match_counts(policy, formatter, scored, max_new_tokens, batch_size)
    return {"eval/accuracy": correct / len(scored), "eval/format_rate": formatted / len(scored),
            "eval/mean_completion_tokens": tokens / len(scored)}


def _generation_eval(trainer: BaseTrainer) -> dict[str, float]:
    """A policy trainer's held-out exact match (its ``eval_records``), greedy, in eval mode; every process takes its
    share (evaluate_exact_match)."""
    if not trainer.eval_records:
        return {}
    trainer.model.eval()
    try:
        with trainer._generating():
            return evaluate_exact_match(trainer.policy, trainer.formatter, trainer.eval_records,
                                        max_new_tokens=trainer.config.eval_max_new_tokens,
                                        batch_size=trainer.config.per_device_eval_batch_size, devices=trainer.devices,
                                        synced=trainer.sharded)
    finally:
        trainer.model.train()


# ---- Stage runners, shared steps ----
# Each stage's runner (train_sft, train_rm, ...) follows its trainer: it checks output_dir and the models a
# config names, reads and splits the records before any model loads, loads the model and trains.


def _split_validation(records: list[dict[str, Any]], val_size: float, seed: int,
                      by_prompt: bool = False) -> tuple[list, list]:
    """A seeded random validation split of ``val_size`` records. ``by_prompt`` holds out whole prompts
    (in a seeded random order, until at least ``val_size`` records are held out): with several pairs per
    prompt, a record-level split leaves held-out prompts, and their chosen answers, in training."""
    if not val_size:
        return records, []
    count = int(val_size) if val_size >= 1 else max(1, round(val_size * len(records)))
    if count >= len(records):
        raise RLHFInputError(f"config field 'val_size' ({val_size}) leaves no training records out of {len(records)}")
    order = random.Random(seed).sample(range(len(records)), len(records))
    if not by_prompt:
        held = set(order[:count])
    else:
        prompts = [json.dumps([record.get("system"), record.get("messages")]) for record in records]
        records_of: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            records_of.setdefault(prompt, []).append(i)
        held = set()
        for i in order:  # each prompt comes up at its first record's place in the seeded order
            if len(held) >= count:
                break
            held.update(records_of[prompts[i]])
        if len(held) >= len(records):
            raise RLHFInputError(f"config field 'val_size' ({val_size}) holds out every prompt with "
                                 f"val_split_by_prompt; give a smaller val_size")
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def _check_answers(records: list[dict[str, Any]] | None, field_name: str, dataset: str, needed_by: str,
                   required: bool = True) -> None:
    """Prompts scored against an 'answer': none at all is a config error when ``required`` (a reward that
    would always be 0), else a warning; some missing is a warning with the count (those go unscored)."""
    if not records:
        return
    missing = [r for r in records if r.get("answer") is None]
    if len(missing) == len(records) and not required:
        logger.warning("%s '%s' has no 'answer' in any of its %d records: %s is not measured", field_name, dataset,
                       len(records), needed_by)
    elif len(missing) == len(records):
        raise RLHFInputError(f"config field '{field_name}': '{dataset}' has no 'answer' in any of its {len(records)} "
                             f"records, and {needed_by} needs one per prompt; give prompts with answers "
                             f"({{\"prompt\", \"answer\"}}, e.g. demo_eval / demo_rl)")
    if missing:
        logger.warning("%s '%s': %d of %d prompts have no 'answer' (e.g. %s); %s skips them", field_name, dataset,
                       len(missing), len(records), missing[0]["location"], needed_by)


def read_stage_records(config: BaseConfig, kind: str
                       ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, validation, held-out prompt) records of ``kind`` for one stage; see read_sft_records."""
    eval_records = load_records(config.eval_dataset, config.dataset_dir, "prompt", max_samples=config.max_samples,
                                media_dir=config.media_dir or None,
                                skip_invalid=config.skip_invalid_records) if config.eval_dataset else []
    # warn only: a pipeline's eval_dataset also feeds the eval stage, where prompts need no answers
    _check_answers(eval_records, "eval_dataset", config.eval_dataset, "exact-match accuracy", required=False)
    if config.streaming:
        if getattr(config, "packing", False):
            raise RLHFInputError("config fields 'streaming' and 'packing' cannot be combined yet; pack in memory or "
                                 "stream unpacked")
        names = [n for n in config.dataset.split(",") if n.strip()]
        if len(names) != 1:
            raise RLHFInputError("config field 'dataset': streaming reads exactly one dataset")
        resolve_dataset(names[0], config.dataset_dir)  # fail now on a missing file or unknown name
        if not config.val_size:
            return None, [], eval_records
        if config.val_size < 1 or config.val_size != int(config.val_size):
            raise RLHFInputError(f"config field 'val_size' ({config.val_size}): a stream has no known length, so "
                                 f"give a record count (e.g. val_size=200), not a fraction")
        # as in LLaMA-Factory: the stream's first val_size records are the validation set, training skips them
        val_records = load_records(names[0], config.dataset_dir, kind, max_samples=int(config.val_size),
                                   media_dir=config.media_dir or None, skip_invalid=config.skip_invalid_records)
        return None, val_records, eval_records
    records = load_records(config.dataset, config.dataset_dir, kind, max_samples=config.max_samples,
                           media_dir=config.media_dir or None, skip_invalid=config.skip_invalid_records)
    train_records, val_records = _split_validation(records, config.val_size, config.seed, config.val_split_by_prompt)
    return train_records, val_records, eval_records


def _streaming_dataset(cls: type[StreamingRecordDataset], config: BaseConfig, tokenizer: Any, formatter: ChatFormatter,
                       devices: DeviceManager, **kwargs: Any) -> StreamingRecordDataset:
    """The streaming twin of a stage's training set: the first dataset, sharded by rank, skipping the
    first val_size records (they are the validation set, as in LLaMA-Factory)."""
    spec = resolve_dataset(config.dataset.split(",")[0].strip(), config.dataset_dir)
    spec.media_dir = Path(config.media_dir or config.dataset_dir)
    return cls(spec, tokenizer, formatter, rank=devices.process_index, world_size=devices.num_processes,
               buffer_size=config.buffer_size, seed=config.seed, skip_invalid=config.skip_invalid_records,
               max_samples=config.max_samples, skip=int(config.val_size or 0), **kwargs)


def _preference_datasets(config: BaseConfig, records: tuple, tokenizer: Any, formatter: ChatFormatter,
                        devices: DeviceManager) -> tuple[Any, Any, list[dict[str, Any]]]:
    """Preference / KTO training and validation sets (streaming twins when ``streaming``)."""
    train_records, val_records, eval_records = records
    kind = STAGE_RECORD_KINDS[config.stage]
    dataset_class = {"preference": PreferenceDataset, "kto": KTODataset}[kind]
    extra = {"seed": config.seed} if kind == "kto" else {}
    validation = (dataset_class(val_records, tokenizer, formatter, cutoff_len=config.cutoff_len, **extra) if val_records
                  else None)
    if train_records is None:
        stream_class = {"preference": StreamingPreferenceDataset, "kto": StreamingKTODataset}[kind]
        train = _streaming_dataset(stream_class, config, tokenizer, formatter, devices, cutoff_len=config.cutoff_len)
    else:
        train = dataset_class(train_records, tokenizer, formatter, cutoff_len=config.cutoff_len, **extra)
    return train, validation, eval_records


def _load_trained_policy(config: BaseConfig, devices: DeviceManager) -> PolicyModel:
    """The model a stage trains: built partitioned under DeepSpeed's zero3_init_flag (``DeviceManager.zero3_init``)."""
    with devices.zero3_init():
        policy = _load_policy(config, devices.device)
    if weight_sharding(policy.model) == "zero3":
        logger.info("%s: built partitioned across %d processes (DeepSpeed zero3_init_flag)", config.model_name_or_path,
                    devices.num_processes)
    return policy


def _refuse_other_stage_checkpoints(config: BaseConfig) -> None:
    """The trainer refuses to resume another stage's checkpoint; say so before any model loads and before this
    run's config.yaml replaces that run's."""
    if config.overwrite_output_dir or config.resume_from_checkpoint != "auto":
        return
    found = _complete_checkpoints(Path(config.output_dir) / "checkpoints")
    state_file = found[-1] / "trainer_state.json" if found else None
    if state_file is not None and state_file.exists():
        try:
            saved = json.loads(state_file.read_text()).get("stage")
        except (OSError, ValueError):  # a damaged checkpoint: resume reports it and falls back to an older one
            return
        if saved and saved != config.stage:
            raise _other_stage_checkpoint_error(found[-1], saved, config.stage, explicit=False)


RUN_MARKERS = ("checkpoints", "logs", "runs", "report.json", "pipeline_config.yaml", "pipeline_stage.json",
               RunFolderLock.name)


def _holds_a_run(directory: Path) -> bool:
    """Whether a directory holds an earlier run (ours, or a training config's): safe to write into."""
    names = {p.name for p in directory.iterdir()}
    if names & set(RUN_MARKERS):
        return True
    config_file = directory / "config.yaml"
    return config_file.is_file() and "model_name_or_path" in config_file.read_text(errors="replace")


def _prepare_output_dir(config: BaseConfig) -> None:
    """Refuse an output_dir that is a file, cannot be written, or is someone else's non-empty folder
    (a run writes config.yaml, README.md model cards and weights there, replacing what it finds)."""
    out = Path(config.output_dir)  # as the run writes it
    if out.exists() and not out.is_dir():
        raise RLHFInputError(f"config field 'output_dir': {out} is a file; give a directory")
    if out.is_dir() and not config.overwrite_output_dir and any(out.iterdir()) and not _holds_a_run(out):
        found = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise RLHFInputError(f"config field 'output_dir': {out} is not empty and holds no earlier run ({found}, ...), "
                             f"and a run would overwrite files there; choose another directory, or set "
                             f"overwrite_output_dir=true to write into it anyway")
    for field_name, directory in (("output_dir", out), ("logging_dir", config.logging_dir)):
        if directory is None:
            continue
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RLHFInputError(f"config field '{field_name}': cannot create {directory} ({err.strerror or err}); "
                                 f"give a writable directory") from None
        if not os.access(directory, os.W_OK):
            raise RLHFInputError(f"config field '{field_name}': {directory} is not writable; give a writable directory")


_MODEL_FIELDS = ("model_name_or_path", "reward_model", "process_reward_model", "value_model", "ref_model",
                 "teacher_model")


def check_model_paths(config: BaseConfig, skip: Iterable[str] = ()) -> None:
    """Every model a config names by a local path exists (``skip``: ones a pipeline trains before they are read),
    so a missing reference or reward model is found before the policy loads and trains, under its own field."""
    skip = set(skip)
    for field_name in _MODEL_FIELDS:
        path = getattr(config, field_name, None)
        if (path and str(path) not in skip and _names_a_local_path(str(path))
                and not Path(str(path)).expanduser().exists()):
            raise RLHFInputError(f"config field '{field_name}': '{path}' does not exist; give a saved model directory "
                                 f"(check the path and the working directory {os.getcwd()})")


def _start_stage(config: BaseConfig, devices: DeviceManager | None, records: tuple | None = None
                 ) -> tuple[tuple, DeviceManager]:
    """Output folder checks, logging, seed, records (validated before any model loads) and devices for one
    stage. ``records``: already read and split (a reward-model ensemble's members share one split)."""
    _prepare_output_dir(config)
    if _launch_rank() == 0:  # held from before the run writes anything there until its runner ends
        RunFolderLock.hold(config.output_dir)  # (releases_output_dir)
    setup_logging(log_file=Path(config.logging_dir or Path(config.output_dir) / "logs") / f"{config.stage}.log")
    set_seed(config.seed)
    if getattr(config, "precompute_ref_log_probs", "false") == "true" and config.streaming:
        raise RLHFInputError("config field 'precompute_ref_log_probs' needs an in-memory dataset; set streaming=false "
                             "or precompute_ref_log_probs=false")
    if records is None:
        records = read_stage_records(config, STAGE_RECORD_KINDS[config.stage])
    check_model_paths(config)  # after the records: a data error names its file:line whatever the model
    _refuse_other_stage_checkpoints(config)
    devices = devices or DeviceManager(config.mixed_precision, config.report_to, Path(config.output_dir) / "runs",
                                       config.ddp_timeout)
    save_config(config, Path(config.output_dir) / "config.yaml")
    return records, devices


# ---- SFT ----
#   config: SFTConfig (below)
#   runner: train_sft; registered by register_stage after it
#   trainer: SFTTrainer.compute_loss
#   loss: causal_lm_loss_with (section 7)


@dataclass
class SFTConfig(BaseConfig):
    """Supervised fine-tuning on prompt/response demonstrations."""

    packing: bool = _opt(False, "Pack several examples per sequence; position ids restart so examples never see each "
                                "other")
    train_on_prompt: bool = _opt(False, "Also compute the loss on prompt tokens (default: only on responses)")
    mask_history: bool = _opt(False, "In multi-turn records, train only on the last assistant turn")

    stage: typing.ClassVar[str] = "sft"


class SFTTrainer(BaseTrainer):
    """Supervised fine-tuning: next-token cross-entropy on response tokens, averaged over every
    target token of the accumulated batch. Evaluates loss / perplexity on held-out records and
    exact-match accuracy by greedy generation on prompts that carry an ``answer``."""

    stage = "sft"

    def __init__(self, config: SFTConfig, policy: PolicyModel, train_dataset: Any, *, eval_dataset: Any = None,
                 eval_records: list[dict[str, Any]] | None = None, formatter: ChatFormatter | None = None,
                 devices: DeviceManager | None = None) -> None:
        super().__init__(config, policy, train_dataset, eval_dataset=eval_dataset, devices=devices)
        self.eval_records = eval_records or []
        self.formatter = formatter or chat_formatter(policy.tokenizer, config, policy)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return self._loss_sum(self.forward_policy, batch)[0], {}

    def _loss_sum(self, policy: PolicyModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        head = OutputHead.of(self.policy)
        scores, _ = head.scores(policy, input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                position_ids=batch.get("position_ids"), **vision_kwargs(batch))
        return causal_lm_loss_with(head, scores, batch["labels"])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        self.model.eval()
        if self.eval_dataset is not None and len(self.eval_dataset):
            metrics.update(self._evaluate_loss())
        if self.eval_records:
            metrics.update(evaluate_exact_match(self.policy, self.formatter, self.eval_records,
                                                max_new_tokens=self.config.eval_max_new_tokens,
                                                batch_size=self.config.per_device_eval_batch_size,
                                                devices=self.devices, synced=self.sharded))
        self.model.train()
        return metrics

    def _evaluate_loss(self) -> dict[str, float]:
        total, count = 0.0, 0
        for items, keep in self._eval_share(self.eval_dataset):
            batch = self._to_device(self.collator(items))
            with self.devices.autocast():
                loss_sum, units = self._loss_sum(self.policy, batch)
            if keep:
                total, count = total + float(loss_sum), count + units
        total, count = self.devices.sum_list_across_processes([total, count])
        mean = total / max(count, 1)
        return {"eval/loss": mean, "eval/perplexity": math.exp(min(mean, 50.0))}


def read_sft_records(config: SFTConfig
                     ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]], list[dict[str, Any]]]:
    """Parse and validate the training, validation and held-out records. Runs before the model loads,
    so a bad record fails in seconds. Streaming reads its training records lazily (returned as None)."""
    return read_stage_records(config, "sft")


def build_sft_data(config: SFTConfig, tokenizer: Any, formatter: ChatFormatter, devices: DeviceManager,
                   records: tuple[list | None, list, list] | None = None
                   ) -> tuple[Any, SFTDataset | None, list[dict[str, Any]]]:
    """Training set (in memory or streaming), validation set, and held-out prompts for accuracy.
    ``records`` is what :func:`read_sft_records` returned, if it already ran."""
    train_records, val_records, eval_records = records or read_sft_records(config)
    common = dict(cutoff_len=config.cutoff_len, train_on_prompt=config.train_on_prompt,
                  mask_history=config.mask_history)
    cached = dict(cache_dir=config.cache_dir, num_proc=config.preprocessing_num_workers, **common)
    validation = SFTDataset(val_records, tokenizer, formatter, **cached) if val_records else None
    if train_records is None:
        return (_streaming_dataset(StreamingSFTDataset, config, tokenizer, formatter, devices, **common), validation,
                eval_records)
    train = SFTDataset(train_records, tokenizer, formatter, packing=config.packing, **cached)
    return train, validation, eval_records


def _check_packing_supported(policy: PolicyModel, config: SFTConfig) -> None:
    if config.packing and policy.vision is not None:
        raise RLHFInputError("config field 'packing': packed rows would lose which images belong to which example "
                             "(vision-language models take their pixel inputs per row); set packing=false")
    if config.packing and policy.model.config.model_type in ("mamba", "mamba2", "rwkv"):
        raise RLHFInputError(f"config field 'packing': {policy.model.config.model_type} models carry state across "
                             f"packed examples, so they would see each other; set packing=false")


@_leaves_logging_as_found
def train_sft(config: SFTConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run the SFT stage from a config: load model and data, train, evaluate, save."""
    return _train_sft_stage(config, devices, SFTTrainer)


@releases_output_dir
def _train_sft_stage(config: SFTConfig, devices: DeviceManager | None, trainer_class: type[SFTTrainer]) -> TrainResult:
    """What a stage that trains on SFT records runs: the policy, its datasets, the trainer (SFTTrainer or a
    subclass)."""
    records, devices = _start_stage(config, devices)
    policy = _load_trained_policy(config, devices)
    _check_packing_supported(policy, config)
    formatter = chat_formatter(policy.tokenizer, config, policy)
    train, validation, eval_records = build_sft_data(config, policy.tokenizer, formatter, devices, records)
    trainer = trainer_class(config, policy, train, eval_dataset=validation, eval_records=eval_records,
                            formatter=formatter, devices=devices)
    return trainer.train()


register_stage(Stage("sft", SFTConfig, train_sft, SFTTrainer, record_kind="sft", optimises_policy=False))


# ---- Reward model ----
#   config: RewardModelConfig (below)
#   runner: train_rm (ensembles: _train_rm_ensemble); registered by register_stage after it
#   trainer: RewardModelTrainer.compute_loss -> _pair_losses
#   loss: reward_model_loss (section 7)


@dataclass
class RewardModelConfig(BaseConfig):
    """Reward model: a scalar head on a transformer, trained on chosen/rejected pairs."""

    reward_head_hidden: int | None = _opt(None, "Hidden width of the 2-layer reward head (default: the backbone's "
                                                "hidden size)")
    center_rewards_coefficient: float = _opt(0.0, "Weight of the reward-centring term mean((r_c + r_r)^2) (Eisenstein "
                                                  "et al. 2023)")
    ensemble_size: int = _opt(1, "Train this many reward models (seeds seed, seed+1, ...) and save them as an ensemble")
    ensemble_strategy: str = _opt("seeds", "How ensemble members differ: seeds (the same pairs in each member's own "
                                  "order) | boosting (each member trains on the pairs resampled by how likely the "
                                  "members before it are to rank them wrong)")

    stage: typing.ClassVar[str] = "rm"

    def _validate(self) -> None:
        super()._validate()
        _check(self.center_rewards_coefficient >= 0, "center_rewards_coefficient", "must be >= 0")
        _check(self.ensemble_size >= 1, "ensemble_size", "must be >= 1")
        _check_choice(self.ensemble_strategy, ENSEMBLE_STRATEGIES, "ensemble_strategy")
        if self.ensemble_strategy == "boosting":
            _check(self.ensemble_size >= 2, "ensemble_strategy",
                   "must be seeds when ensemble_size is 1 (boosting needs ensemble_size >= 2)")
            _check(not self.streaming, "ensemble_strategy",
                   "must be seeds with streaming (boosting resamples the training pairs in memory; set "
                   "streaming=false)")
        _check(self.reward_head_hidden is None or self.reward_head_hidden > 0, "reward_head_hidden", "must be > 0")


@dataclass
class PairScores:
    """One batch of pairs through a reward model: per-pair losses (B, with grad), chosen and rejected
    scores (B, detached) and, for a process reward model, its labelled steps ranked right / labelled."""

    losses: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor
    steps_right: int = 0
    steps_labelled: int = 0


class RewardModelTrainer(BaseTrainer):
    """Pairwise reward modelling: -log sigmoid(r_chosen - r_rejected - margin), optionally plus the
    reward-centring term; the loss is a mean over pairs. Evaluates pairwise accuracy on held-out pairs."""

    stage = "rm"

    def __init__(self, config: RewardModelConfig, reward_model: RewardModel, train_dataset: Any, *,
                 eval_dataset: Any = None, devices: DeviceManager | None = None) -> None:
        super().__init__(config, reward_model, train_dataset, eval_dataset=eval_dataset, devices=devices,
                         collator=PreferenceCollator(reward_model.tokenizer.pad_token_id))

    def loss_units(self, batch: PreferenceBatch) -> int:
        return batch["input_ids"].shape[0] // 2

    def _pair_losses(self, batch: PreferenceBatch) -> PairScores:
        scores = self.forward_policy(batch["input_ids"], batch["attention_mask"])  # (2B)
        chosen, rejected = scores.float().chunk(2)
        losses = reward_model_loss(chosen, rejected, batch.get("margin"))
        if self.config.center_rewards_coefficient:
            losses = losses + self.config.center_rewards_coefficient * (chosen + rejected) ** 2
        return PairScores(losses, chosen.detach(), rejected.detach())

    def compute_loss(self, batch: PreferenceBatch) -> tuple[torch.Tensor, dict[str, float]]:
        pairs = self._pair_losses(batch)
        losses, chosen, rejected = pairs.losses, pairs.chosen, pairs.rejected
        return losses.sum(), {"rewards/accuracies": float((chosen > rejected).float().mean()),
                              "rewards/margins": float((chosen - rejected).mean()),
                              "rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean())}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pairwise accuracy, mean loss and margin (and a PRM's labelled-step accuracy)."""
        if self.eval_dataset is None or not len(self.eval_dataset):
            return {}
        self.model.eval()
        sums = [0.0] * 6  # loss, pairs ranked right, margin, pairs, labelled steps right, labelled steps
        for items, keep in self._eval_share(self.eval_dataset):
            with self.devices.autocast():
                pairs = self._pair_losses(self._to_device(self.collator(items)))
            if keep:
                margin = pairs.chosen - pairs.rejected
                found = [pairs.losses.sum(), (margin > 0).sum(), margin.sum(), len(margin), pairs.steps_right,
                         pairs.steps_labelled]
                sums = [total + float(value) for total, value in zip(sums, found)]
        self.model.train()
        loss, right, margin, pairs, steps_right, steps = self.devices.sum_list_across_processes(sums)
        metrics = {"eval/loss": loss / pairs, "eval/accuracy": right / pairs, "eval/margin": margin / pairs}
        if steps:
            metrics["eval/step_accuracy"] = steps_right / steps
        return metrics

    def _save_model(self, directory: Path) -> None:
        formatter = chat_formatter(self.policy.tokenizer, self.config)
        with saved_as_trained(None, self.policy.tokenizer, formatter):
            RewardModel(self.devices.unwrap(self.policy.model), self.policy.tokenizer).save_pretrained(
                directory, chat_template=formatter.saved_template(), state_dict=self.gathered_weights)

    def _load_model(self, directory: Path) -> None:
        RewardModel(self.devices.unwrap(self.policy.model), self.policy.tokenizer).load_weights(directory)


@releases_output_dir
def _train_reward_model(config: RewardModelConfig, devices: DeviceManager | None, records: tuple | None = None
                        ) -> TrainResult:
    records, devices = _start_stage(config, devices, records)
    with devices.zero3_init():  # the model this stage trains
        reward_model = RewardModel.from_pretrained(config.model_name_or_path, dtype=_model_dtype(config),
                                                   attn_implementation=config.attn_implementation,
                                                   trust_remote_code=config.trust_remote_code, device=devices.device,
                                                   cache_dir=config.cache_dir, head_hidden=config.reward_head_hidden,
                                                   seed=config.seed, quantization=quantization_config(config))
    formatter = chat_formatter(reward_model.tokenizer, config)
    train, validation, _ = _preference_datasets(config, records, reward_model.tokenizer, formatter, devices)
    return RewardModelTrainer(config, reward_model, train, eval_dataset=validation, devices=devices).train()


def _boosting_resample(records: list[dict[str, Any]], weights: torch.Tensor, ranked_right: torch.Tensor,
                       seed: int) -> list[dict[str, Any]]:
    """As many training pairs as before, drawn with replacement in proportion to ``weights`` (the members
    so far's reward_boosting_weights); ``ranked_right`` (bool) only feeds the log line."""
    drawn = torch.multinomial(weights.double(), len(records), replacement=True,
                              generator=torch.Generator().manual_seed(seed)).tolist()
    logger.info("boosting: %d training pairs drawn from %d distinct; %.0f%% of the weight is on the %d pairs the "
                "members so far rank wrong", len(drawn), len(set(drawn)),
                100 * float(weights[~ranked_right].sum() / weights.sum()), int((~ranked_right).sum()))
    return [records[i] for i in drawn]


@torch.no_grad()
def _reward_margins(config: RewardModelConfig, directory: str | os.PathLike, records: list[dict[str, Any]],
                    devices: DeviceManager | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A saved reward model's (or ensemble's mean) score of chosen minus rejected on each pair, and the
    pairs' data margins (0 where the data has none). Every process scores all pairs. Shapes: -> (N), (N)."""
    from accelerate import PartialState

    device = devices.device if devices else PartialState().device
    ensemble = RewardEnsemble.from_pretrained(str(directory), dtype=_model_dtype(config), device=device,
                                              attn_implementation=config.attn_implementation,
                                              trust_remote_code=config.trust_remote_code, cache_dir=config.cache_dir,
                                              is_trainable=False).eval()
    pairs = PreferenceDataset(records, ensemble.tokenizer, chat_formatter(ensemble.tokenizer, config),
                              cutoff_len=config.cutoff_len)
    collate = PreferenceCollator(ensemble.tokenizer.pad_token_id)
    margins, data_margins = [], []
    for start in range(0, len(pairs), config.per_device_eval_batch_size):
        batch = collate([pairs[i] for i in range(start, min(start + config.per_device_eval_batch_size, len(pairs)))])
        chosen, rejected = ensemble(batch["input_ids"].to(device),
                                    batch["attention_mask"].to(device))[0].float().chunk(2)
        margins.append(chosen - rejected)
        data_margins.append(batch.get("margin", torch.zeros(len(chosen))).to(device).expand(len(chosen)))
    return torch.cat(margins), torch.cat(data_margins)


def _evaluate_reward_ensemble(config: RewardModelConfig, val_records: list[dict[str, Any]],
                              devices: DeviceManager | None) -> dict[str, float]:
    """Pairwise accuracy, loss and margin of the saved ensemble's mean score on the held-out pairs."""
    margin, data_margin = _reward_margins(config, config.output_dir, val_records, devices)
    losses = reward_model_loss(margin, torch.zeros_like(margin), data_margin)
    return {"eval/loss": float(losses.mean()), "eval/accuracy": float((margin > 0).float().mean()),
            "eval/margin": float(margin.mean())}


def _train_rm_ensemble(config: RewardModelConfig, devices: DeviceManager | None) -> TrainResult:
    """Members differ by seed (head init, data order) but share the base seed's train/validation split:
    with a split per member, each would train on pairs the others hold out, and the ensemble would have
    no held-out pairs left. Its eval metrics score the ensemble itself (the mean of the members' scores,
    what downstream stages use), with each member's accuracy beside them.

    With ``ensemble_strategy: boosting`` each member after the first trains on the training pairs drawn
    again, with replacement, in proportion to ``reward_boosting_weights`` of the members before it: the
    pairs they rank wrong or barely right. A reward model can settle on one check and stay blind to another
    that it learns readily alone (the demo's: the units digit of a sum, not the tens); the next member is
    pushed to learn the one it missed, and their mean covers both."""
    started, members = time.time(), []
    records = read_stage_records(config, STAGE_RECORD_KINDS[config.stage])
    train_records = records[0]
    score_sum = data_margin = torch.zeros(len(train_records or []))  # members' chosen - rejected on training pairs
    for k in range(config.ensemble_size):
        member = dataclasses.replace(config, ensemble_size=1, ensemble_strategy="seeds", seed=config.seed + k,
                                     output_dir=str(Path(config.output_dir) / f"member-{k}"))
        logger.info("reward-model ensemble: member %d of %d (seed %d)", k + 1, config.ensemble_size, member.seed)
        member_records = records
        if config.ensemble_strategy == "boosting" and k > 0:
            weights = reward_boosting_weights(score_sum / k, torch.zeros_like(score_sum), data_margin)
            member_records = (_boosting_resample(train_records, weights, score_sum > 0, member.seed), *records[1:])
        members.append(_train_reward_model(member, devices, member_records))
        if config.ensemble_strategy == "boosting" and k < config.ensemble_size - 1:
            scores, data_margin = (t.cpu() for t in _reward_margins(config, member.output_dir, train_records, devices))
            score_sum = score_sum + scores
    RewardEnsemble.write_manifest(config.output_dir, [f"member-{k}" for k in range(config.ensemble_size)])
    metrics = {"steps": sum(m.global_step for m in members),
               "train_loss": float(np.mean([m.metrics["train_loss"] for m in members])),
               **{f"member_{k}/eval_accuracy": m.eval.get("eval/accuracy", float("nan"))
                  for k, m in enumerate(members)}}
    evaluation = _evaluate_reward_ensemble(config, records[1], devices) if records[1] else {}
    if evaluation:
        logger.info("reward-model ensemble of %d: held-out pairwise accuracy %.1f%% (members %s)",
                    config.ensemble_size, 100 * evaluation["eval/accuracy"],
                    ", ".join(f"{100 * m.eval.get('eval/accuracy', float('nan')):.1f}%" for m in members))
    return TrainResult("rm", Path(config.output_dir), members[-1].global_step, time.time() - started, metrics,
                       evaluation, None, [], False)


@_leaves_logging_as_found
def train_rm(config: RewardModelConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run the reward-model stage: one model, or ``ensemble_size`` members (seeds seed, seed+1, ...)
    saved under output_dir/member-k with an ensemble.json manifest."""
    if config.ensemble_size > 1:
        return _train_rm_ensemble(config, devices)
    stale = Path(config.output_dir) / RewardEnsemble.MANIFEST
    if stale.exists() and _launch_rank() == 0:  # an earlier ensemble's manifest would shadow this model on loading
        logger.warning("%s: removing %s left by an earlier ensemble run", config.output_dir, RewardEnsemble.MANIFEST)
        stale.unlink()
    return _train_reward_model(config, devices)


register_stage(Stage("rm", RewardModelConfig, train_rm, RewardModelTrainer, record_kind="preference",
                     makes_policy=False, optimises_policy=False))


# ---- Process reward model ----
#   config: ProcessRewardModelConfig (below)
#   runner: train_prm; registered by register_stage after it
#   trainer: ProcessRewardModelTrainer.compute_loss -> _pair_losses
#   loss: reward_model_loss on aggregate_step_scores, plus step-label BCE (sections 5, 4)


@dataclass
class ProcessRewardModelConfig(RewardModelConfig):
    """Process reward model: a score per reasoning step, trained on chosen/rejected pairs (outcome
    ranking of the aggregated step scores) plus per-step labels where the data has them."""

    step_delimiter: str = _opt("\n", "Text that ends a reasoning step (escape sequences like \\n are understood)")
    prm_aggregation: str = _opt("min", "How step scores make a response's score: min | product | last")
    step_label_weight: float = _opt(1.0, "Weight of the per-step cross-entropy on labelled steps (0: outcome ranking "
                                         "only)")
    prm_step_labeler: str = _opt("none", "Label steps without labels in the data: none | arithmetic (the demo's "
                                         "verifier)")

    stage: typing.ClassVar[str] = "prm"

    def _normalise(self) -> None:
        super()._normalise()
        if "\\" in self.step_delimiter:  # YAML/CLI users write \n for a newline
            self.step_delimiter = self.step_delimiter.encode().decode("unicode_escape")

    def _validate(self) -> None:
        super()._validate()
        _check(bool(self.step_delimiter), "step_delimiter", "must not be empty")
        _check_choice(self.prm_aggregation, PRM_AGGREGATIONS, "prm_aggregation")
        _check_choice(self.prm_step_labeler, ("none", "arithmetic"), "prm_step_labeler")
        _check(self.step_label_weight >= 0, "step_label_weight", "must be >= 0")
        _check(self.ensemble_size == 1, "ensemble_size", "must be 1 for a process reward model")


class ProcessRewardModelTrainer(RewardModelTrainer):
    """Process reward model training: the aggregated step scores of chosen and rejected are ranked
    pairwise (an outcome signal every preference pair has), and labelled steps add a binary
    cross-entropy weighted by ``step_label_weight`` (the PRM800K / Math-Shepherd signal).
    Evaluates pairwise accuracy of the aggregated scores and accuracy on labelled steps."""

    stage = "prm"

    def __init__(self, config: ProcessRewardModelConfig, model: ProcessRewardModel, train_dataset: Any, *,
                 eval_dataset: Any = None, devices: DeviceManager | None = None) -> None:
        BaseTrainer.__init__(self, config, model, train_dataset, eval_dataset=eval_dataset, devices=devices,
                             collator=ProcessPreferenceCollator(model.tokenizer.pad_token_id))

    def _pair_losses(self, batch: dict[str, torch.Tensor]) -> PairScores:
        model = self.forward_policy
        logits = model.step_logits(batch["input_ids"], batch["attention_mask"],
                                   batch["step_positions"]).float()  # (2B, S)
        scores = aggregate_step_scores(logits, batch["step_mask"], model.aggregation)
        chosen, rejected = scores.chunk(2)
        losses = reward_model_loss(chosen, rejected, batch.get("margin"))
        labelled = (batch["step_labels"] >= 0) & batch["step_mask"]
        if self.config.step_label_weight and labelled.any():
            bce = F.binary_cross_entropy_with_logits(logits, batch["step_labels"].clamp(min=0),
                                                     reduction="none") * labelled
            per_row = bce.sum(-1) / labelled.sum(-1).clamp(min=1)  # mean over each response's labelled steps
            losses = losses + self.config.step_label_weight * sum(per_row.chunk(2))
        steps_right = int((((logits > 0).float() == batch["step_labels"]) & labelled).sum())
        return PairScores(losses, chosen.detach(), rejected.detach(), steps_right, int(labelled.sum()))

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        pairs = self._pair_losses(batch)
        metrics = {"rewards/accuracies": float((pairs.chosen > pairs.rejected).float().mean()),
                   "rewards/margins": float((pairs.chosen - pairs.rejected).mean())}
        if pairs.steps_labelled:
            metrics["steps/accuracy"] = pairs.steps_right / pairs.steps_labelled
        return pairs.losses.sum(), metrics

    def _save_model(self, directory: Path) -> None:
        model = self.policy
        ProcessRewardModel(self.devices.unwrap(model.model), model.tokenizer, model.step_delimiter,
                           model.aggregation).save_pretrained(directory, state_dict=self.gathered_weights)

    def _load_model(self, directory: Path) -> None:
        RewardModel(self.devices.unwrap(self.policy.model), self.policy.tokenizer).load_weights(directory)


@_leaves_logging_as_found
@releases_output_dir
def train_prm(config: ProcessRewardModelConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run the process-reward-model stage on preference pairs (step labels from the data or a labeler)."""
    records, devices = _start_stage(config, devices)
    with devices.zero3_init():  # the model this stage trains
        model = ProcessRewardModel.from_pretrained(config.model_name_or_path, dtype=_model_dtype(config),
                                                   attn_implementation=config.attn_implementation,
                                                   trust_remote_code=config.trust_remote_code, device=devices.device,
                                                   cache_dir=config.cache_dir, head_hidden=config.reward_head_hidden,
                                                   seed=config.seed, step_delimiter=config.step_delimiter,
                                                   aggregation=config.prm_aggregation,
                                                   quantization=quantization_config(config))
    formatter = chat_formatter(model.tokenizer, config)
    train_records, val_records, _ = records
    if train_records is None:
        raise RLHFInputError("config field 'streaming': the prm stage reads its pairs in memory; set streaming=false")
    common = dict(cutoff_len=config.cutoff_len, delimiter=config.step_delimiter, labeler=config.prm_step_labeler)
    train = ProcessPreferenceDataset(train_records, model.tokenizer, formatter, **common)
    validation = ProcessPreferenceDataset(val_records, model.tokenizer, formatter, **common) if val_records else None
    return ProcessRewardModelTrainer(config, model, train, eval_dataset=validation, devices=devices).train()


register_stage(Stage("prm", ProcessRewardModelConfig, train_prm, ProcessRewardModelTrainer,
                     record_kind="preference", makes_policy=False, optimises_policy=False))


# ---- Reference-model trainers, shared steps (DPO family, KTO; the online stages build on _ReferenceTrainer) ----


@dataclass
class PolicyLogProbs:
    """One forward of a concatenated batch: summed (LD-weighted) and per-token-averaged completion
    log-probs, completion lengths and mean logits over completion tokens. Shapes: all (2B)."""

    summed: torch.Tensor
    averaged: torch.Tensor
    lengths: torch.Tensor
    mean_logits: torch.Tensor


def _completion_forward(policy: PolicyModel, batch: PreferenceBatch, ld_alpha: float | None = None
                        ) -> PolicyLogProbs:
    if "completion_input_ids" in batch:
        per_token, mask, mean_logits = shared_prefix_log_probs(policy.model, batch)
        lengths = mask.sum(-1).clamp(min=1)
        return PolicyLogProbs(sequence_log_probs(per_token, mask, ld_alpha), per_token.sum(-1) / lengths, lengths,
                              mean_logits)
    head = OutputHead.of(policy)
    scores, _ = head.scores(policy, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            **vision_kwargs(batch))
    scores = scores[:, :-1]
    mask = batch["labels"][:, 1:] != IGNORE_INDEX  # (2B, T-1)
    per_token = head.log_probs(scores, batch["input_ids"][:, 1:]) * mask
    lengths = mask.sum(-1).clamp(min=1)
    mean_logits = (head.mean_logits(scores) * mask).sum(-1) / lengths
    return PolicyLogProbs(sequence_log_probs(per_token, mask, ld_alpha), per_token.sum(-1) / lengths, lengths,
                          mean_logits)


def _reference_logps(reference: ReferenceModel, batch: PreferenceBatch, ld_alpha: float | None = None) -> torch.Tensor:
    """Summed reference log-probs of every row of a concatenated batch, with the policy's weighting."""
    if "completion_input_ids" in batch:
        per_token, mask = reference.shared_prefix_log_probs(batch)
        return sequence_log_probs(per_token, mask, ld_alpha).detach()
    out = reference.compute_log_probs(batch["input_ids"], batch["attention_mask"], batch["labels"],
                                      **vision_kwargs(batch))
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    return sequence_log_probs(out.per_token, mask, ld_alpha).detach()


@torch.no_grad()
def precompute_ref_log_probs(reference: ReferenceModel, dataset: _EncodedRecords, collator: Callable, *,
                             batch_size: int, device: torch.device | str, ld_alpha: float | None = None,
                             keys: tuple[str, str] = ("ref_chosen_logps", "ref_rejected_logps"),
                             devices: DeviceManager | None = None) -> int:
    """Reference log-probs for every item, computed once before training and stored on the
    dataset (``keys`` name the first and second half of each concatenated row pair), so that no
    reference model has to stay in memory while training. With several processes (``devices``) each
    computes every num_processes-th batch and all of them receive every result, so the work is split
    and the batches (hence the values) are those of one process. Every process runs the same number
    of forwards (one that runs out repeats its last batch), since a sharded model (ZeRO-3, FSDP)
    gathers its parameters in every forward, collectively. Returns the batches computed here."""
    starts = range(0, len(dataset), batch_size)
    share = devices.lockstep_share(len(starts)) if devices is not None else [(i, True) for i in range(len(starts))]
    computed: dict[int, tuple[list[float], list[float]]] = {}
    for index, keep in share:
        start = starts[index]
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        batch = {k: v.to(device) for k, v in collator(items).items()}
        logps = _reference_logps(reference, batch, ld_alpha).float().cpu()
        if keep:
            computed[start] = (logps[:len(items)].tolist(), logps[len(items):].tolist())
    mine = len(computed)
    if devices is not None and devices.num_processes > 1:
        for part in devices.gather_object(computed):
            computed.update(part)
    dataset.attach(keys[0], [value for start in starts for value in computed[start][0]])
    dataset.attach(keys[1], [value for start in starts for value in computed[start][1]])
    return mine


REFERENCE_CACHE_FILE = "reference_log_probs.safetensors"


def reference_cache_fingerprint(datasets: list[Any], keys: tuple[str, str], config: BaseConfig) -> str:
    """What precomputed reference log-probs depend on: every item's token ids (and image tensors), the
    reference (model and ref_model paths, LoRA or not) and the weighting (ld_alpha). A stored cache is used
    only when this matches, so a changed dataset or reference never reads stale values."""
    digest = hashlib.sha256(json.dumps([list(keys), config.model_name_or_path, getattr(config, "ref_model", None),
                                        config.finetuning_type, getattr(config, "ld_alpha", None)]).encode())
    for dataset in datasets:
        digest.update(f"dataset {len(dataset)}".encode())
        for item in (dataset[i] for i in range(len(dataset))):
            for key in sorted(k for k in item if k not in keys):
                value = item[key]
                digest.update(key.encode())
                if isinstance(value, torch.Tensor):
                    digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
                elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                    digest.update(array.array("q", value).tobytes())
                else:
                    digest.update(repr(value).encode())
    return digest.hexdigest()


def reference_cache_tensors(datasets: list[Any], keys: tuple[str, str]) -> dict[str, torch.Tensor]:
    """The attached values as tensors named ``{dataset index}.{key}`` (float64 holds each float exactly)."""
    return {f"{index}.{key}": torch.tensor([dataset[i][key] for i in range(len(dataset))], dtype=torch.float64)
            for index, dataset in enumerate(datasets) for key in keys}


def read_reference_cache(path: Path, fingerprint: str) -> dict[str, torch.Tensor] | None:
    """A stored reference cache's tensors when ``path`` exists, reads and carries ``fingerprint``; else None."""
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            if (handle.metadata() or {}).get("fingerprint") != fingerprint:
                return None
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError) as err:
        logger.warning("ignoring %s (%s): the reference log-probs are computed again", path, _one_line(err))
        return None


class _ReferenceTrainer(BaseTrainer):
    """Shared by DPO and KTO: the reference model (live, or precomputed and freed) and the
    held-out exact-match evaluation of the policy."""

    reference_keys = ("ref_chosen_logps", "ref_rejected_logps")

    def _setup_reference(self, reference: ReferenceModel | None, datasets: list[Any]) -> None:
        self.reference = reference.to(self.devices.device) if reference is not None else None
        self.reference_cache: dict[str, torch.Tensor] = {}  # what a checkpoint stores (reference_cache_tensors)
        if reference is None or not self._precompute_reference(datasets):
            return
        datasets = [d for d in datasets if d is not None and len(d)]
        fingerprint = reference_cache_fingerprint(datasets, self.reference_keys, self.config)
        started, batches, source = time.time(), 0, self._cached_reference(datasets, fingerprint)
        if source is None:
            for dataset in datasets:
                batches += precompute_ref_log_probs(reference, dataset, self.collator, device=self.devices.device,
                                                    batch_size=self.config.per_device_eval_batch_size,
                                                    ld_alpha=getattr(self.config, "ld_alpha", None),
                                                    keys=self.reference_keys, devices=self.devices)
        self.reference_cache = reference_cache_tensors(datasets, self.reference_keys)
        self.reference_fingerprint = fingerprint
        self.reference = None  # nothing of the reference stays referenced by the trainer
        gc.collect()
        if source is not None:
            logger.info("reference log-probs read from %s (computed by the run that wrote it); reference model "
                        "released", source)
        else:
            logger.info("reference log-probs precomputed in %.1fs (%d batches by this process of %d); reference "
                        "model released", time.time() - started, batches, self.devices.num_processes)

    def _precompute_reference(self, datasets: list[Any]) -> bool:
        """``precompute_ref_log_probs``: true / false as given; auto precomputes when a live reference would run
        more forwards than one pass over the data (several epochs, or the held-out set evaluated more than once),
        or when a checkpoint this run resumes from holds them already. Decided from the whole run's settings, so a
        resumed run decides as the uninterrupted one did."""
        choice = self.config.precompute_ref_log_probs
        if choice != "auto":
            return choice == "true"
        if self.sampler is None or not all(hasattr(d, "attach") for d in datasets if d is not None):
            return False  # streaming, or a dataset (e.g. a Subset) with no place to keep the values
        train, held_out = (len(d) if d is not None else 0 for d in datasets)
        passes = self.total_steps * self.config.gradient_accumulation_steps / self.sampler.batches_per_epoch
        live = passes * train + self._evaluations() * held_out
        precomputed = train + held_out
        if any((path / REFERENCE_CACHE_FILE).exists() for path in self._resume_candidates()):
            logger.info("precompute_ref_log_probs=auto: on (a checkpoint of this run holds them)")
            return True
        decision = live > precomputed
        logger.info("precompute_ref_log_probs=auto: %s (a live reference would run %.0f item forwards, precomputing "
                    "%d)", "on" if decision else "off", live, precomputed)
        return decision

    def _evaluations(self) -> int:
        """How many times the run evaluates its held-out set (every eval_steps, at the end, and before)."""
        steps, every = self.total_steps, self.config.eval_steps
        periodic = steps // every if every else 0
        final = 0 if every and steps % every == 0 else 1
        return periodic + final + int(bool(self.config.eval_before_training))

    def _resume_candidates(self) -> list[Path]:
        """Checkpoints this run may resume from, newest first (none when it starts over)."""
        choice = self.config.resume_from_checkpoint
        if self.config.overwrite_output_dir or choice == "none":
            return []
        return [Path(choice)] if choice != "auto" else self.checkpoints.checkpoints()[::-1]

    def _cached_reference(self, datasets: list[Any], fingerprint: str) -> Path | None:
        """Attach the values a checkpoint of this run stored, when one holds them for these items and this
        reference (its fingerprint matches); the file they came from, or None."""
        for path in self._resume_candidates():
            tensors = read_reference_cache(path / REFERENCE_CACHE_FILE, fingerprint)
            if tensors is not None:
                for index, dataset in enumerate(datasets):
                    for key in self.reference_keys:
                        dataset.attach(key, tensors[f"{index}.{key}"].tolist())
                return path / REFERENCE_CACHE_FILE
        return None

    def _write_checkpoint(self, directory: Path) -> None:
        super()._write_checkpoint(directory)
        if getattr(self, "reference_cache", None):  # a resumed run reads them back instead of running the reference
            save_file(self.reference_cache, str(directory / REFERENCE_CACHE_FILE),
                      metadata={"fingerprint": self.reference_fingerprint})

    def _reference_pair(self, batch: PreferenceBatch | KTOBatch) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = self.reference_keys
        if first in batch:
            return batch[first], batch[second]
        if self.reference is None:
            raise RLHFInputError("reference log-probs are neither precomputed nor computable: no reference model")
        return _reference_logps(self.reference, batch, getattr(self.config, "ld_alpha", None)).float().chunk(2)

    def _generation_eval(self) -> dict[str, float]:
        return _generation_eval(self)

    @torch.no_grad()
    def _mean_over(self, dataset: Any,
                   metric_fn: Callable[[dict[str, torch.Tensor]], dict[str, float]]) -> dict[str, float]:
        if dataset is None or not len(dataset):
            return {}
        self.model.eval()
        rows = []
        for items, keep in self._eval_share(dataset):
            with self.devices.autocast():
                metrics = metric_fn(self._to_device(self.collator(items)))
            if keep:
                rows.append((len(items), metrics))
        self.model.train()
        if self.devices.num_processes > 1:
            rows = [row for part in self.devices.gather_object(rows) for row in part]
        keys = dict.fromkeys(k for _, r in rows for k in r)  # some batches lack a metric (e.g. no undesirable row)
        return {f"eval/{k}": sum(n * r[k] for n, r in rows if k in r) / sum(n for n, r in rows if k in r)
                for k in keys}


@releases_output_dir
def _train_policy_stage(config: BaseConfig, devices: DeviceManager | None, trainer_class: type[BaseTrainer]
                        ) -> TrainResult:
    records, devices = _start_stage(config, devices)
    policy = _load_trained_policy(config, devices)
    formatter = chat_formatter(policy.tokenizer, config, policy)
    train, validation, eval_records = _preference_datasets(config, records, policy.tokenizer, formatter, devices)
    reference = create_reference_model(config, policy)
    return trainer_class(config, policy, train, eval_dataset=validation, reference=reference, eval_records=eval_records,
                         formatter=formatter, devices=devices).train()


PRECOMPUTE_REF_HELP = ("Reference log-probs computed once before training (the reference model then freed) and "
                       "stored with each checkpoint: true | false (live reference in every step) | auto (true when a "
                       "live reference would run more forwards: several epochs, or repeated evaluations)")


def _normalise_precompute(value: Any) -> str:
    """precompute_ref_log_probs given as a bool (TRL's type) or a word: one of auto / true / false."""
    word = str(value).strip().lower()
    word = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(word, word)
    _check_choice(word, ("auto", "true", "false"), "precompute_ref_log_probs")
    return word


# ---- DPO family (DPO, IPO, hinge, robust, BCO, ..., SimPO, ORPO) ----
#   config: DPOConfig, SimPOConfig, ORPOConfig (below)
#   runner: train_dpo (the dpo, simpo and orpo stages); registered by register_stage after it
#   trainer: DPOTrainer.compute_loss -> pair_losses; SimPOTrainer (the simpo stage, and pref_loss simpo)
#   loss: dpo_loss / PREFERENCE_LOSSES, simpo_loss, orpo_loss (section 7)


@dataclass
class DPOConfig(BaseConfig):
    """Direct preference optimisation and its family (pref_loss), on chosen/rejected pairs."""

    pref_beta: float = _opt(0.1, "beta: strength of the implicit KL regulariser (SimPO: reward scale, e.g. 2.0)")
    pref_loss: str = _opt("sigmoid", "Loss: " + " | ".join(PREF_LOSSES))
    pref_ftx: float = _opt(0.0, "Weight of the SFT (NLL) loss on chosen responses mixed into the preference loss")
    pref_bco_weight: float = _opt(0.0, "Blend in the BCO pair loss with this weight: (loss + w * bco) / (1 + w)")
    dpo_label_smoothing: float = _opt(0.0, "Label-flip rate for cDPO / robust / exo (0 to 0.5)")
    ld_alpha: float | None = _opt(None, "LD-DPO: weight of response tokens beyond the chosen/rejected shared length "
                                        "(0-1)")
    simpo_gamma: float = _opt(0.5, "SimPO target reward margin gamma")
    ref_model: str | None = _opt(None, "Reference model directory (default: the starting model; LoRA uses the "
                                       "adapter-disabled base)")
    precompute_ref_log_probs: str = _opt("auto", PRECOMPUTE_REF_HELP)
    share_prompt: bool = _opt(True, "Run each pair's prompt once and share its KV cache between chosen and rejected "
                                    "(off for Mamba and gradient checkpointing)")
    padding_free: bool = _opt(True, "With share_prompt: pack each batch's pairs into rows without padding (prompt "
                                    "once, chosen and rejected as branches under a tree attention mask); sdpa / eager "
                                    "attention only, else share_prompt's KV-cache path")

    stage: typing.ClassVar[str] = "dpo"

    def _validate(self) -> None:
        super()._validate()
        self.precompute_ref_log_probs = _normalise_precompute(self.precompute_ref_log_probs)
        _check_choice(self.pref_loss, PREF_LOSSES, "pref_loss")
        _check(self.pref_beta > 0, "pref_beta", "must be > 0")
        _check(self.pref_ftx >= 0 and self.pref_bco_weight >= 0, "pref_ftx/pref_bco_weight", "must be >= 0")
        _check(0 <= self.dpo_label_smoothing < 0.5, "dpo_label_smoothing", "must be in [0, 0.5)")
        _check(self.ld_alpha is None or 0 <= self.ld_alpha <= 1, "ld_alpha", "must be in [0, 1] (or omit it)")
        _check(not (self.ref_model and not self.uses_reference), "ref_model",
               f"is unused: pref_loss '{self.pref_loss}' is reference-free; remove ref_model, or choose a loss with a "
               f"reference (e.g. sigmoid)")

    @property
    def uses_reference(self) -> bool:
        return self.pref_loss not in ("orpo", "simpo")


@dataclass
class SimPOConfig(DPOConfig):
    """SimPO: reference-free preference optimisation on length-averaged log-probs with a target margin."""

    pref_loss: str = _opt("simpo", "Loss: simpo (the default here) or any of " + " | ".join(PREF_LOSSES))
    pref_beta: float = _opt(2.0, "SimPO reward scale beta")

    stage: typing.ClassVar[str] = "simpo"


@dataclass
class ORPOConfig(DPOConfig):
    """ORPO: reference-free odds-ratio preference optimisation plus the SFT loss on chosen responses."""

    pref_loss: str = _opt("orpo", "Loss: orpo (the default here) or any of " + " | ".join(PREF_LOSSES))

    stage: typing.ClassVar[str] = "orpo"


class DPOTrainer(_ReferenceTrainer):
    """The DPO family, ORPO and SimPO (``pref_loss``), with chosen and rejected in one forward.

    The loss is a mean over pairs. ``pref_ftx`` mixes in the chosen responses' NLL (per-token
    average), ``pref_bco_weight`` blends in BCO with a running reward shift, ``ld_alpha`` applies
    LD-DPO's length desensitisation to policy and reference log-probs alike.
    """

    stage = "dpo"

    def __init__(self, config: DPOConfig, policy: PolicyModel, train_dataset: Any, *, eval_dataset: Any = None,
                 reference: ReferenceModel | None = None, eval_records: list[dict[str, Any]] | None = None,
                 formatter: ChatFormatter | None = None, devices: DeviceManager | None = None) -> None:
        self.stage = config.stage
        self.eval_records = eval_records or []
        self.formatter = formatter or chat_formatter(policy.tokenizer, config, policy)
        self.bco_delta = 0.0  # BCO's running mean reward (Jung et al. 2024 sec. 3.2)
        self.bco_count = 0
        if config.uses_reference and reference is None:
            raise RLHFInputError(f"pref_loss={config.pref_loss} needs a reference model; pass one "
                                 f"(see create_reference_model) or use orpo / simpo")
        if config.pref_loss == "simpo" and not isinstance(self, SimPOTrainer):
            raise RLHFInputError("pref_loss=simpo trains with SimPOTrainer (train_dpo picks it); construct that "
                                 "instead")
        # the packed layout needs no KV cache, so unlike the prompt/completion rows it runs under gradient checkpointing
        # a vision-language model takes its pixel inputs with the whole rows (its image features replace the prompt's
        # image tokens inside the forward), so its pairs run as plain concatenated rows
        text_only = policy.vision is None
        pack = text_only and config.share_prompt and config.padding_free and can_pack_pairs(policy.model)
        share = pack or (text_only and config.share_prompt and not config.gradient_checkpointing
                         and policy.model.config.model_type not in PREFIX_SHARING_EXCLUDED)
        super().__init__(config, policy, train_dataset, eval_dataset=eval_dataset, devices=devices,
                         collator=PreferenceCollator(policy.tokenizer.pad_token_id, share_prompt=share, pack_pairs=pack,
                                                     hidden_size=text_config(policy.model).hidden_size,
                                                     vision=policy.vision))
        self._setup_reference(reference if config.uses_reference else None, [train_dataset, eval_dataset])

    def loss_units(self, batch: PreferenceBatch) -> int:
        return batch["input_ids"].shape[0] // 2

    def pair_losses(self, batch: PreferenceBatch, update_running: bool = True
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-pair losses (B) and TRL-named metrics for one concatenated batch."""
        config = self.config
        out = _completion_forward(self.forward_policy, batch, config.ld_alpha)
        chosen_avg = out.averaged.chunk(2)[0]
        losses, chosen_rewards, rejected_rewards, metrics = self.preference_losses(out, batch, update_running)
        if config.pref_ftx and config.pref_loss != "orpo":
            losses = losses + config.pref_ftx * -chosen_avg
            metrics["sft_loss"] = float(-chosen_avg.detach().mean())
        logps_chosen, logps_rejected = out.summed.detach().chunk(2)
        logits_chosen, logits_rejected = out.mean_logits.chunk(2)
        metrics.update({"rewards/chosen": float(chosen_rewards.mean()),
                        "rewards/rejected": float(rejected_rewards.mean()),
                        "rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
                        "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
                        "logps/chosen": float(logps_chosen.mean()), "logps/rejected": float(logps_rejected.mean()),
                        "logits/chosen": float(logits_chosen.mean()), "logits/rejected": float(logits_rejected.mean())})
        return losses, metrics

    def preference_losses(self, out: Any, batch: PreferenceBatch, update_running: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
        """(losses, chosen rewards, rejected rewards) per pair and the loss's own metrics: ORPO, or a
        PREFERENCE_LOSSES loss against the reference (with BCO's running shift where it applies)."""
        config = self.config
        chosen_avg, rejected_avg = out.averaged.chunk(2)
        metrics: dict[str, float] = {}
        if config.pref_loss == "orpo":
            odds_losses, chosen_rewards, rejected_rewards, log_odds = orpo_loss(chosen_avg, rejected_avg,
                                                                                beta=config.pref_beta)
            losses = -chosen_avg + odds_losses  # Hong et al. eq. 6: NLL of chosen + beta * odds-ratio loss
            metrics.update(odds_ratio=float(log_odds.mean()), sft_loss=float(-chosen_avg.detach().mean()))
        else:
            policy_chosen, policy_rejected = out.summed.chunk(2)
            ref_chosen, ref_rejected = self._reference_pair(batch)
            chosen_lengths, rejected_lengths = out.lengths.chunk(2)
            common = dict(beta=config.pref_beta, label_smoothing=config.dpo_label_smoothing,
                          chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
            if update_running and (config.pref_loss == "bco_pair" or config.pref_bco_weight):
                # BCO's shift includes this batch, as in TRL: update the running mean, then use it
                self._update_bco_delta(config.pref_beta * torch.cat([policy_chosen - ref_chosen,
                                                                     policy_rejected - ref_rejected]).detach())
            losses, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, policy_rejected, ref_chosen,
                                                                ref_rejected, loss_type=config.pref_loss,
                                                                bco_delta=self.bco_delta, **common)
            if config.pref_bco_weight:
                bco, _, _ = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, loss_type="bco_pair",
                                     bco_delta=self.bco_delta, **common)
                losses = (losses + config.pref_bco_weight * bco) / (1 + config.pref_bco_weight)
        return losses, chosen_rewards, rejected_rewards, metrics

    def _update_bco_delta(self, rewards: torch.Tensor) -> None:
        """Running mean of every implicit reward seen so far (TRL's RunningMoments, mean part), over all
        processes' rewards, so that every process shifts by the same delta."""
        total, count = self.devices.sum_list_across_processes([float(rewards.sum()), rewards.numel()])
        self.bco_delta = (self.bco_delta * self.bco_count + total) / (self.bco_count + count)
        self.bco_count += int(count)

    def compute_loss(self, batch: PreferenceBatch) -> tuple[torch.Tensor, dict[str, float]]:
        losses, metrics = self.pair_losses(batch)
        return losses.sum(), metrics

    def evaluate(self) -> dict[str, float]:
        def metric_fn(batch: PreferenceBatch) -> dict[str, float]:
            losses, metrics = self.pair_losses(batch, update_running=False)
            return {"loss": float(losses.mean()), **metrics}

        return {**self._mean_over(self.eval_dataset, metric_fn), **self._generation_eval()}

    def _extra_state(self) -> dict[str, Any]:
        return {"bco_delta": self.bco_delta, "bco_count": self.bco_count}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.bco_delta, self.bco_count = state.get("bco_delta", 0.0), state.get("bco_count", 0)


class SimPOTrainer(DPOTrainer):
    """SimPO (Meng et al. 2024): the reference-free margin loss on length-averaged log-probs (simpo_loss), for the
    simpo stage and for any DPO-family config whose pref_loss is simpo. No reference model is loaded."""

    stage = "simpo"

    def preference_losses(self, out: Any, batch: PreferenceBatch, update_running: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
        config = self.config
        chosen_avg, rejected_avg = out.averaged.chunk(2)
        losses, chosen_rewards, rejected_rewards = simpo_loss(chosen_avg, rejected_avg, beta=config.pref_beta,
                                                              gamma=config.simpo_gamma,
                                                              label_smoothing=config.dpo_label_smoothing)
        return losses, chosen_rewards, rejected_rewards, {}


@_leaves_logging_as_found
def train_dpo(config: DPOConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run a DPO-family stage (dpo / simpo / orpo; pref_loss picks the loss, and SimPOTrainer trains simpo)."""
    return _train_policy_stage(config, devices, SimPOTrainer if config.pref_loss == "simpo" else DPOTrainer)


register_stage(Stage("dpo", DPOConfig, train_dpo, DPOTrainer, record_kind="preference"))
register_stage(Stage("simpo", SimPOConfig, train_dpo, SimPOTrainer, record_kind="preference"))
register_stage(Stage("orpo", ORPOConfig, train_dpo, DPOTrainer, record_kind="preference"))


# ---- KTO ----
#   config: KTOConfig (below)
#   runner: train_kto; registered by register_stage after it
#   trainer: KTOTrainer.compute_loss -> example_losses
#   loss: kto_loss (section 7)


@dataclass
class KTOConfig(BaseConfig):
    """KTO: preference optimisation from single responses labelled desirable or undesirable."""

    pref_beta: float = _opt(0.1, "beta: strength of the implicit KL regulariser")
    kto_chosen_weight: float = _opt(1.0, "Weight of desirable examples (lambda_D)")
    kto_rejected_weight: float = _opt(1.0, "Weight of undesirable examples (lambda_U)")
    ref_model: str | None = _opt(None, "Reference model directory (default: the starting model; LoRA uses the "
                                       "adapter-disabled base)")
    precompute_ref_log_probs: str = _opt("auto", PRECOMPUTE_REF_HELP)

    stage: typing.ClassVar[str] = "kto"
    uses_reference: typing.ClassVar[bool] = True

    def _validate(self) -> None:
        super()._validate()
        self.precompute_ref_log_probs = _normalise_precompute(self.precompute_ref_log_probs)
        _check(self.pref_beta > 0, "pref_beta", "must be > 0")
        _check(self.kto_chosen_weight > 0 and self.kto_rejected_weight > 0, "kto_chosen_weight/kto_rejected_weight",
               "must be > 0")
        if self.per_device_train_batch_size * self.gradient_accumulation_steps < 4:
            logger.warning("KTO with %d examples per step: the KL reference point is estimated from that many "
                           "mismatched pairs, so it will be noisy; LLaMA-Factory's examples use 8",
                           self.per_device_train_batch_size * self.gradient_accumulation_steps)


class KTOTrainer(_ReferenceTrainer):
    """KTO (Ethayarajh et al. 2024) on desirable/undesirable examples. Each batch also runs its
    mismatched (prompt, completion) pairs, whose policy/reference log-ratio gives the KL reference
    point z0 (detached, clamped at 0)."""

    stage = "kto"
    reference_keys = ("ref_logps", "ref_kl_logps")

    def __init__(self, config: KTOConfig, policy: PolicyModel, train_dataset: Any, *, eval_dataset: Any = None,
                 reference: ReferenceModel | None = None, eval_records: list[dict[str, Any]] | None = None,
                 formatter: ChatFormatter | None = None, devices: DeviceManager | None = None) -> None:
        if reference is None:
            raise RLHFInputError("KTO needs a reference model (see create_reference_model)")
        self.eval_records = eval_records or []
        self.formatter = formatter or chat_formatter(policy.tokenizer, config, policy)
        super().__init__(config, policy, train_dataset, eval_dataset=eval_dataset, devices=devices,
                         collator=KTOCollator(policy.tokenizer.pad_token_id, vision=policy.vision))
        self._setup_reference(reference, [train_dataset, eval_dataset])

    def loss_units(self, batch: KTOBatch) -> int:
        return int(batch["desirable"].numel())

    def example_losses(self, batch: KTOBatch,
                       across_processes: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """``across_processes``: z0 from every process's micro-batch (training), or from this batch alone
        (evaluation, where processes hold different held-out batches and one process must give the same figures)."""
        config = self.config
        out = _completion_forward(self.forward_policy, batch)
        policy_logps, policy_kl_logps = out.summed.chunk(2)
        ref_logps, ref_kl_logps = self._reference_pair(batch)
        # z0 estimates the KL over the whole batch: with several processes, the mean of every process's
        # estimate (as TRL gathers them), so all ranks' losses share one reference point
        kl = (policy_kl_logps.detach() - ref_kl_logps).mean()[None]
        kl = (self.devices.gather(kl) if across_processes else kl).mean().clamp(min=0)
        desirable = batch["desirable"]
        losses, rewards = kto_loss(policy_logps, ref_logps, desirable, kl, beta=config.pref_beta,
                                   desirable_weight=config.kto_chosen_weight,
                                   undesirable_weight=config.kto_rejected_weight)
        metrics = {"kl": float(kl)}
        logps = policy_logps.detach()
        for name, rows in (("chosen", desirable), ("rejected", ~desirable)):
            if rows.any():
                metrics[f"rewards/{name}"] = float(rewards[rows].mean())
                metrics[f"logps/{name}"] = float(logps[rows].mean())
                metrics[f"logits/{name}"] = float(out.mean_logits[: len(desirable)][rows].mean())
        if desirable.any() and (~desirable).any():
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return losses, metrics

    def compute_loss(self, batch: KTOBatch) -> tuple[torch.Tensor, dict[str, float]]:
        losses, metrics = self.example_losses(batch)
        return losses.sum(), metrics

    def evaluate(self) -> dict[str, float]:
        def metric_fn(batch: KTOBatch) -> dict[str, float]:
            losses, metrics = self.example_losses(batch, across_processes=False)
            return {"loss": float(losses.mean()), **metrics}

        return {**self._mean_over(self.eval_dataset, metric_fn), **self._generation_eval()}


@_leaves_logging_as_found
def train_kto(config: KTOConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run the KTO stage."""
    return _train_policy_stage(config, devices, KTOTrainer)


register_stage(Stage("kto", KTOConfig, train_kto, KTOTrainer, record_kind="kto"))


# ---- Online RL, shared steps: rollouts, sampling, rewards (GRPO, RLOO, REINFORCE++, online DPO, distill, PPO) ----


class _OnlineRLTrainer(BaseTrainer):
    """Shared by every online stage: prompts -> sampled episodes -> rewards -> a :class:`Rollout` that feeds
    ``steps_per_rollout`` optimizer steps. Sampling is section 9's: a PromptStream of prompts, a rollout scheduler
    (ROLLOUT_SCHEDULERS), an episode source (EPISODE_SOURCES), the rollout engine (ROLLOUT_ENGINES, kept in step by a
    SyncedEngine) and a RolloutScorer; a subclass's ``make_rollout`` turns episodes and scores into rows, advantages
    and log-probs. A resumed run samples the interrupted rollout again from its prompts (with the restored RNG) and
    skips the steps it had already taken."""

    def __init__(self, config: OnlineRLConfig, policy: PolicyModel, train_dataset: Any, *, reward_fn: RewardFn,
                 reference: ReferenceModel | None = None, eval_records: list[dict[str, Any]] | None = None,
                 formatter: ChatFormatter | None = None, devices: DeviceManager | None = None) -> None:
        if getattr(config, "uses_reference", True) and reference is None:
            raise RLHFInputError(f"{config.stage} needs a reference model here (see create_reference_model)"
                                 + (", or set beta=0" if isinstance(config, GRPOConfig) else ""))
        self.eval_records = eval_records or []
        self.formatter = formatter or chat_formatter(policy.tokenizer, config, policy)
        self.normalizer = RunningRewardNormalizer() if self._normalise_rewards(config) else None
        self.watchdog = RolloutWatchdog(0)  # armed while a rollout is made (rollout_timeout)
        self.rollout_index = 0
        self.current_rollout: Rollout | None = None
        self.resumed_rollout: Rollout | None = None  # the interrupted rollout, read back from a checkpoint
        self.rollouts_to_save: list[Rollout] = []  # every process's current rollout, for the checkpoint being written
        self.source = EPISODE_SOURCES[episode_source_name(config)](config, policy, self.formatter)
        self._check_image_prompts(config, policy, train_dataset)
        super().__init__(config, policy, train_dataset, devices=devices, collator=list)
        self.reference = (reference.to(self.devices.device) if getattr(config, "uses_reference", True)
                          and reference is not None else None)
        self.scorer = RolloutScorer(config, reward_fn, policy.decode, drops_failed=self.drops_failed_episodes)
        weights = PolicyWeightSource(policy, lambda: self.model, self.devices, lambda: self.global_step, self.sharded)
        scheduler = ROLLOUT_SCHEDULERS[rollout_scheduler_name(config)]
        context = EngineContext(config, policy, self.devices, weights, self._sampling_mode, self._rollouts_left,
                                self.sharded, self.source.one_shape_per_rollout,
                                getattr(scheduler, "updates_weights_in_flight", False))
        self.engine = SyncedEngine(lambda: ROLLOUT_ENGINES[rollout_engine_name(config)](context), weights,
                                   self.devices)
        self.rollout_scheduler = scheduler(config, self.source, self.engine, self._sampling_params,
                                           self.steps_per_rollout)

    takes_images = False  # whether the stage trains on image prompts (a vision-language policy's)
    # an online stage that can leave a failed episode's group out of the loss (GRPO and its estimators); the others
    # stop with one line when a reward cannot be had after the retries
    drops_failed_episodes = False

    def _check_image_prompts(self, config: OnlineRLConfig, policy: PolicyModel, train_dataset: Any) -> None:
        items = getattr(train_dataset, "items", [])
        if policy.vision is None or not any(item.get("images") for item in items):
            return
        if not self.takes_images:
            raise RLHFInputError(f"stage '{config.stage}' does not train on image prompts; grpo, rloo and reinforce_pp "
                                 f"do (or give this stage text prompts)")
        if config.use_vllm is True:
            raise RLHFInputError("config field 'use_vllm': image prompts are sampled with this project's engine; "
                                 "passing their pixels to vLLM is not supported yet, so set use_vllm: false")
        if config.rollout_dtype != "auto":
            raise RLHFInputError(f"config field 'rollout_dtype': image prompts are sampled from the policy itself, "
                                 f"not a {config.rollout_dtype} copy: set rollout_dtype: auto")
        if not self.source.takes_images:
            raise RLHFInputError("config field 'environment': episodes with tools run on text prompts; image prompts "
                                 "train without an environment")

    # -- subclass interface
    prompts_per_rollout: int
    steps_per_rollout: int
    completions_per_prompt: int  # sampled for each prompt of a rollout
    passes_per_rollout: int  # how many times the steps of one rollout train on each of its completions

    def _normalise_rewards(self, config: OnlineRLConfig) -> bool:
        return config.reward_normalize

    def make_rollout(self, prompts: list[dict[str, Any]]) -> Rollout:
        raise NotImplementedError

    def rollout_schedule(self, rollout: Rollout) -> list[dict[str, torch.Tensor]]:
        """Every micro-batch the rollout's steps_per_rollout optimizer steps train on, in order."""
        raise NotImplementedError

    # -- the plan: which prompts each rollout samples, and how many rollouts the run makes
    def _setup_schedule(self) -> None:
        config = self.config
        self.prompts = PromptStream(self.train_dataset, self.prompts_per_rollout, config.seed,
                                    self.devices.process_index, self.devices.num_processes)
        self.sampler = self.prompts.sampler  # the checkpoint keeps a streaming set's position when there is none
        if self.sampler is None:
            self.total_steps = config.max_steps
        else:
            rollouts = math.ceil(config.num_train_epochs * self.sampler.batches_per_epoch)
            self.total_steps = config.max_steps if config.max_steps > 0 else max(1, rollouts * self.steps_per_rollout)
        logger.info("%s", self.rollout_plan())

    def rollout_plan(self) -> str:
        """How many completions the run samples. max_steps counts optimizer steps, and a rollout feeds
        steps_per_rollout of them, so PPO at ppo_epochs 4 samples a quarter of what 1 would in as many steps."""
        rollouts, passes = math.ceil(self.total_steps / self.steps_per_rollout), self.passes_per_rollout
        per_rollout = self.prompts_per_rollout * self.completions_per_prompt * self.devices.num_processes
        return (f"{self.stage}: {self.total_steps} optimizer steps = {rollouts} rollout{'s' * (rollouts != 1)} of "
                f"{per_rollout} completions ({rollouts * per_rollout:,} sampled), each trained on "
                + ("once" if passes == 1 else f"{passes} times"))

    def _epoch(self) -> float:
        return self.prompts.epoch(self.global_step / self.steps_per_rollout)

    def _rollouts_left(self) -> int | None:
        """The rollouts this run still plans, this one included; None where the work ahead is unknown."""
        if not self.total_steps or self.total_steps < 0:
            return None
        done = getattr(self, "global_step", 0) // self.steps_per_rollout
        return max(1, math.ceil(self.total_steps / self.steps_per_rollout) - done)

    # -- the loop's batches: each rollout's micro-batches, a rollout made when the last one's steps are done
    def make_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        accumulation = self.config.gradient_accumulation_steps
        index, steps_done = divmod(self.global_step, self.steps_per_rollout)
        resumed = self.resumed_rollout if steps_done else None  # a checkpoint taken inside a rollout kept it
        self.resumed_rollout = None
        first = index + (resumed is not None)
        ledger = RolloutLedger(self.output_dir, first, write=self.devices.is_main_process)
        batches = with_lookahead(self.prompts.batches(first), self.rollout_scheduler.lookahead)
        while True:
            self.rollout_index = index  # seeds the rollout's draws (rollout_seed)
            if resumed is None:
                batch, upcoming = next(batches)
                rollout = self._next_rollout(batch, upcoming)
                ledger.record(index, self.global_step + 1, self.devices.gather_object(batch.positions))
            else:
                rollout = resumed
            resumed, self.current_rollout = None, rollout
            schedule = self.rollout_schedule(rollout)
            for position in range(steps_done * accumulation, len(schedule)):
                if position % accumulation == 0:
                    self.pending_problem = rollout.skip_reason  # each step on a bad rollout skips its update
                    if position == steps_done * accumulation:
                        self.step_metrics = rollout.metrics  # logged once, with the rollout's first step
                yield schedule[position]
            index, steps_done = index + 1, 0

    def _next_rollout(self, batch: PromptBatch, upcoming: list[PromptBatch]) -> Rollout:
        self.rollout_scheduler.plan(upcoming)
        try:
            with RolloutWatchdog(self.config.rollout_timeout) as self.watchdog:
                return self.make_rollout(batch.prompts)
        except RolloutHung as hung:
            raise RLHFInputError(f"rollout {self.rollout_index} stopped: {hung}; look at it, or raise "
                                 f"rollout_timeout. {self._resume_advice()}") from None
        except RolloutStopped as stopped:
            raise RLHFInputError(f"{stopped} {self._resume_advice()}") from None
        finally:
            self.watchdog = RolloutWatchdog(0)

    def _sampling_params(self, n: int, rollout_index: int) -> SamplingParams:
        return rollout_sampling_params(self.config, n, rollout_index, rank=self.devices.process_index,
                                       world_size=self.devices.num_processes,
                                       stop_token_ids=self.formatter.stop_token_ids,
                                       suppress_token_ids=self.policy.suppressed_tokens)

    def _sample(self, prompts: list[dict[str, Any]], n: int) -> Episodes:
        """``n`` episodes per prompt of this rollout, from the scheduler (with completion lengths and sampling time in
        their metrics)."""
        started = time.time()
        try:
            episodes = self.rollout_scheduler.sample(prompts, n, self.rollout_index, self.global_step,
                                             self.watchdog.progress)
        except VLLMServerError as error:  # the server stayed down through every retry, or a sync stalled
            raise RolloutStopped(f"stage {self.stage}, step {self.global_step}: {error}.") from None
        episodes.metrics.update({**completion_metrics(episodes), "perf/generation_s": time.time() - started})
        return episodes

    def _sampling_mode(self) -> contextlib.AbstractContextManager:
        """Where our engine samples: eval mode (no dropout), and a sharded policy's gathering (``_generating``)."""
        stack = contextlib.ExitStack()
        self.model.eval()
        stack.callback(self.model.train)
        stack.enter_context(self._generating())
        return stack

    # -- from episodes to rows: the engine's log-probs beside the trainer's, the reference's
    def _rows(self, records: list[dict[str, Any]], completions: list[list[int]], masked: list[bool] | None = None,
              observed: list[list[bool]] | None = None) -> Rollout:
        return rollout_rows(records, completions, self.policy.tokenizer.pad_token_id, masked, observed)

    def _trainer_sampled_logps(self, scores: torch.Tensor, input_ids: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The trainer's log-probs under the distribution the engine reports its log-probs of: vLLM's are of the
        narrowed distribution it sampled from, ours of the whole one (``full``, as when nothing narrows it)."""
        config = self.config
        if not self.engine.logprobs_after_truncation or not (config.top_k or config.top_p < 1 or config.min_p > 0):
            return full
        return OutputHead.of(self.policy).sampled_log_probs(scores, input_ids[:, 1:], config.temperature,
                                                            top_k=config.top_k, top_p=config.top_p, min_p=config.min_p)

    def _engine_correction(self, rollout: Rollout, episodes: Episodes, trainer_sampled: torch.Tensor | None) -> None:
        metrics = engine_correction(self.config, rollout, episodes, trainer_sampled)
        rollout.metrics.update({f"{self.engine.metric_prefix}/{k}": v for k, v in metrics.items()})

    def _engine_gap(self, rollout: Rollout, episodes: Episodes) -> dict[str, float]:
        """The engine/trainer log-prob mismatch on a rollout, for trainers whose loss takes no correction."""
        sampled = []
        with torch.no_grad(), self.devices.autocast():
            for batch in rollout.micro_batches(self.config.per_device_train_batch_size):
                batch = _trim_columns(self._to_device(batch))
                scores, _ = OutputHead.of(self.policy).scores(self.policy, input_ids=batch["input_ids"],
                                                              attention_mask=batch["attention_mask"])
                full = OutputHead.of(self.policy).log_probs(scores[:, :-1], batch["input_ids"][:, 1:],
                                                            self.config.temperature)
                trainer = self._trainer_sampled_logps(scores[:, :-1], batch["input_ids"], full)
                sampled.append(F.pad(trainer.cpu(), (0, rollout.labels.shape[1] - 1 - trainer.shape[1])))
        _, metrics = rollout_importance_weights(torch.cat(sampled), engine_log_probs(rollout, episodes),
                                                rollout.completion_mask)
        return {f"{self.engine.metric_prefix}/{k}": v for k, v in metrics.items() if not k.startswith("is_")}

    def _reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.reference._frozen():
            model = self.reference.model
            scores, _ = OutputHead.of(model).scores(model, input_ids=batch["input_ids"],
                                                    attention_mask=batch["attention_mask"])
            return OutputHead.of(model).log_probs(scores[:, :-1], batch["input_ids"][:, 1:], self.config.temperature)

    # -- checkpoints: a checkpoint taken inside a rollout keeps every process's rollout
    def _save_checkpoint(self) -> None:
        # each process trains on a rollout of its own prompts, and only the main process writes: a checkpoint
        # taken inside a rollout collects every process's rollout first (all processes get here together)
        inside = bool(self.global_step % self.steps_per_rollout) and self.current_rollout is not None
        self.rollouts_to_save = self.devices.gather_object(self.current_rollout) if inside else []
        # a scheduler sampling ahead: its rollouts, once done, so a resume trains on them as this run will
        buffered = getattr(self.rollout_scheduler, "buffered", list)()
        self.buffers_to_save = self.devices.gather_object({
            "rollouts": [[ids, episodes_to_json(episodes)] for ids, episodes in buffered],
            "dropped": getattr(self.rollout_scheduler, "dropped", 0)})
        super()._save_checkpoint()

    def _write_checkpoint(self, directory: Path) -> None:
        super()._write_checkpoint(directory)
        save_rollouts(directory, self.rollouts_to_save)
        save_buffers(directory, self.buffers_to_save)

    def _load_checkpoint(self, path: Path) -> None:
        super()._load_checkpoint(path)
        if self.global_step % self.steps_per_rollout:
            self.resumed_rollout = load_rollout(path, self.devices.process_index, self.devices.num_processes)
        buffer = load_buffer(path, self.devices.process_index, self.devices.num_processes)
        if buffer is not None and hasattr(self.rollout_scheduler, "restore"):
            self.rollout_scheduler.restore(*buffer)
        elif buffer is not None:
            logger.warning("%s holds rollouts sampled ahead, and rollout_scheduler %s samples none ahead: they are "
                           "not used", path, rollout_scheduler_name(self.config))

    # -- evaluation: held-out answers from the policy (or the engine, when it holds the policy at its precision)
    def evaluate(self) -> dict[str, float]:
        engine = self.engine.at(self.global_step) if self.eval_records else None
        if engine is not None and engine.holds_weights and getattr(engine, "answers_evaluation", False):
            self.policy.rollout_engine = engine
        try:
            metrics = _generation_eval(self)
        finally:
            self.policy.rollout_engine = None
        if not isinstance(self.source, SingleTurnSource) and metrics:
            metrics = {**{f"{name}_without_environment": value for name, value in metrics.items()},
                       **self._environment_eval()}
        return metrics

    @torch.no_grad()
    def _environment_eval(self) -> dict[str, float]:
        """Held-out exact match when the policy answers through its episode source (greedy episodes, tools
        answering), as it does in training; ``evaluate`` keeps the plain greedy answers as
        ``eval/accuracy_without_environment``. Every process plays every episode (greedy, so identically)."""
        scored = [r for r in self.eval_records if r.get("answer") is not None]
        params = SamplingParams(max_new_tokens=self.config.max_completion_length, temperature=0.0, n=1,
                                stop_token_ids=tuple(self.formatter.stop_token_ids))
        size, engine = self.config.per_device_eval_batch_size, self.engine.at(self.global_step)
        correct, formatted, tokens, calls = 0.0, 0.0, 0.0, 0.0
        for start in range(0, len(scored), size):
            chunk = scored[start:start + size]
            prompts = [_encode_prompt(self.formatter, record, self.config.cutoff_len)[0] for record in chunk]
            episodes = self.source.sample(prompts, params, engine, self.watchdog.progress)
            engine.sleep()
            counts = _exact_match_tally(self.policy, chunk, episodes.token_ids)
            correct, formatted, tokens = correct + counts[0], formatted + counts[1], tokens + counts[2]
            calls += episodes.metrics["tools/calls_per_episode"] * len(chunk)
        count = max(len(scored), 1)
        return {"eval/accuracy": correct / count, "eval/format_rate": formatted / count,
                "eval/mean_completion_tokens": tokens / count, "eval/tool_calls_per_episode": calls / count}

    def train(self) -> TrainResult:
        try:
            return super().train()
        finally:
            self.close_rollouts()

    def close_rollouts(self) -> None:
        """Stop sampling ahead, close the engine and the episode source (idempotent)."""
        self.rollout_scheduler.close()
        self.policy.rollout_engine = None
        self.engine.close()
        self.source.close()

    def _extra_state(self) -> dict[str, Any]:
        return {"reward_normalizer": self.normalizer.state_dict() if self.normalizer else None}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if self.normalizer is not None and state.get("reward_normalizer"):
            self.normalizer.load_state_dict(state["reward_normalizer"])



def _prompt_datasets(config: BaseConfig, records: tuple, tokenizer: Any, formatter: ChatFormatter,
                     devices: DeviceManager) -> tuple[Any, list[dict[str, Any]]]:
    """Online-RL prompts (streaming twin when ``streaming``) and the held-out prompts for accuracy."""
    train_records, _, eval_records = records
    if train_records is not None:
        return GRPODataset(train_records, tokenizer, formatter, cutoff_len=config.cutoff_len), eval_records
    return _streaming_dataset(StreamingGRPODataset, config, tokenizer, formatter, devices,
                              cutoff_len=config.cutoff_len), eval_records


def _check_reward_answers(config: OnlineRLConfig, train_records: list[dict[str, Any]] | None) -> None:
    """exact_answer compares with each prompt's 'answer': without them every reward is 0 and nothing trains."""
    if "exact_answer" in config.reward_names():
        _check_answers(train_records, "dataset", config.dataset, "the exact_answer reward")


# ---- GRPO ----
#   config: GRPOConfig, RLOOConfig, ReinforcePPConfig (below; on OnlineRLConfig, section 1); rewards:
#           RewardFunctionFactory (section 8)
#   runner: train_grpo; registered by register_stage after it
#   trainer: GRPOTrainer.make_rollout (grpo_advantages) -> compute_loss
#   loss: grpo_loss (section 7)


@dataclass
class GRPOConfig(OnlineRLConfig):
    """GRPO: online RL from groups of sampled completions scored by reward functions (Shao et al. 2024)."""

    num_generations: int = _opt(8, "Completions sampled per prompt (the group G)")
    beta: float = _opt(0.04, "Weight of the k3 KL penalty to the reference model (0: no reference model is loaded)")
    epsilon_low: float = _opt(0.2, "Lower clip range of the probability ratio")
    epsilon_high: float | None = _opt(None, "Upper clip range (DAPO's clip-higher; default: epsilon_low)")
    loss_type: str = _opt("grpo", "Policy loss (POLICY_LOSSES): grpo (per-sequence mean) | bnpo (per-micro-batch token "
                                  "mean) | dapo (token mean over the step) | dr_grpo (sum / (B * "
                                  "max_completion_length)) | cispo (MiniMax-M1: clipped importance weight times "
                                  "log-prob, token mean) | module:function registered with rlhf.register_policy_loss")
    advantage_estimator: str = _opt("grpo", "grpo (group mean and std) | rloo (mean of the other completions) | "
                                            "reinforce_pp (token returns, KL in the reward, whitened over the batch) | "
                                            "reinforce_pp_baseline (group mean subtracted first)")
    importance_sampling_level: str = _opt("token", "token: a ratio per token | sequence: GSPO's length-normalised "
                                                   "sequence ratio (use epsilon_low ~3e-4, epsilon_high ~4e-4)")
    episode_source: str = _opt("auto", "What one sample of a prompt is (EPISODE_SOURCES): auto (single_turn without an "
                                       "environment, agent_program with environment: agent, tool_environment with "
                                       "any other) | single_turn | tool_environment | agent_program | a name "
                                       "registered with rlhf.register_episode_source")
    environment: str | None = _opt(None, "Multi-turn tool use: calculator | http (environment_url) | agent (your "
                                         "agent program through an OpenAI-compatible endpoint: agent) | "
                                         "module:function returning an Environment; tool outputs join the context "
                                         "and are never trained on")
    environment_url: str | None = _opt(None, "environment http: the service's base URL (POST /reset and /step)")
    environment_timeout: float = _opt(30.0, "Seconds one environment call may take (http: one request) before it "
                                            "counts as failed and is retried")
    environment_retries: int = _opt(3, "environment http: attempts per request (exponential backoff between them)")
    agent: str | None = _opt(None, "environment agent: module:function(client, record) -> reward, your agent program, "
                                   "run once per episode with an openai.OpenAI client whose base_url serves the "
                                   "policy (its requests are sampled, batched, recorded and trained on)")
    agent_port: int = _opt(0, "environment agent: the port of the OpenAI-compatible endpoint on 127.0.0.1 (0: a "
                              "free one)")
    agent_batch_wait: float = _opt(0.0, "environment agent: 0 samples a batch once every running episode has a "
                                        "request in (the same batches, so the same samples, in every run); > 0: "
                                        "also after this many seconds, so an episode busy with a slow tool does not "
                                        "hold the others up")
    agent_trajectory: str = _opt("concatenated", "environment agent: concatenated (each episode one trajectory: its "
                                                 "answers trained, what the agent added between requests observed) "
                                                 "| per_call (each request a row of its own, with its episode's "
                                                 "advantage; for agents that rewrite their history)")
    max_turns: int = _opt(4, "With an environment: policy turns per episode at most (agent: requests)")
    max_turn_tokens: int | None = _opt(None, "With an environment: tokens one turn may generate (default: "
                                             "max_completion_length, which bounds the whole completion, tool outputs "
                                             "included)")
    tool_format: str = _opt("tag", "tag: a call is the text between tool_tags and its output joins the turn inside "
                                   "tool_result_tags | chat_template: JSON calls (<tool_call>{...}</tool_call>) ending "
                                   "the turn, outputs rendered as the template's tool messages")
    tool_tags: list[str] = _opt(["<calc>", "</calc>"], "tag format: the opening and closing tags of a tool call")
    tool_result_tags: list[str] = _opt(["<result>", "</result>"], "tag format: the tags around a tool's output")
    dynamic_sampling: bool = _opt(False, "DAPO: drop groups whose completions all scored alike and sample more prompts "
                                         "until the rollout holds its number of informative groups")
    max_sampling_rounds: int = _opt(3, "dynamic_sampling: sampling rounds per rollout at most; groups still missing "
                                       "then are left out of the loss")
    scale_rewards: str = _opt("group", "Divide centred rewards by the group's std (group), the batch's (batch) or "
                                       "nothing (none, Dr. GRPO)")
    num_iterations: int = _opt(1, "Optimizer steps per rollout (mu); > 1 reuses it with stored old log-probs and "
                                  "clipping")
    mask_truncated_completions: bool = _opt(False, "Leave completions that hit max_completion_length out of the loss "
                                                   "(DAPO)")
    share_prompt: bool = _opt(True, "Run each group's prompt once per micro-batch and share its KV cache among the G "
                                    "completions (off for Mamba and gradient checkpointing)")
    padding_free: bool = _opt(True, "With share_prompt: pack each micro-batch's groups into rows (the prompt once, "
                                    "every completion a branch under a tree attention mask) when that is less work "
                                    "than padded completion rows; sdpa / eager attention only")
    skip_zero_gradient_rows: bool = _opt(True, "Skip the forward and backward of completions that add exactly nothing "
                                               "to the update (with beta 0: zero advantage, e.g. a group scored alike, "
                                               "or no token left in the loss); the update is the same, entropy and "
                                               "clip metrics cover the rows that trained")

    stage: typing.ClassVar[str] = "grpo"

    def _normalise(self) -> None:
        super()._normalise()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon_low
        self.advantage_estimator = ADVANTAGE_ESTIMATOR_ALIASES.get(self.advantage_estimator, self.advantage_estimator)

    def _validate(self) -> None:
        super()._validate()
        _check(self.num_generations >= 2, "num_generations",
               "must be >= 2 (advantages compare completions of one prompt"
               + ("; dynamic_sampling keeps groups whose completions scored differently)" if self.dynamic_sampling
                  else ")"))
        _check(self.max_sampling_rounds >= 1, "max_sampling_rounds", "must be >= 1")
        if self.environment:
            _check_choice(self.tool_format, TOOL_FORMATS, "tool_format")
            _check(len(self.tool_tags) == 2 and len(self.tool_result_tags) == 2 and all(self.tool_tags),
                   "tool_tags/tool_result_tags", "need two tags each: the opening one and the closing one")
            _check(self.max_turns >= 1, "max_turns", "must be >= 1")
            _check(self.max_turn_tokens is None or self.max_turn_tokens >= 1, "max_turn_tokens", "must be >= 1")
            _check(self.environment != "http" or bool(self.environment_url), "environment_url",
                   "is required with environment: http (the service's base URL)")
            _check(self.environment != "agent" or bool(self.agent), "agent",
                   "is required with environment: agent (module:function(client, record) -> reward)")
            _check(0 <= self.agent_port < 65536, "agent_port", "must be a port number, or 0 for a free one")
            _check_choice(self.agent_trajectory, ("concatenated", "per_call"), "agent_trajectory")
            _check(self.agent_batch_wait >= 0, "agent_batch_wait", "must be >= 0 (0: wait for every episode)")
            _check(self.environment != "agent" or self.agent_trajectory == "concatenated"
                   or not self.advantage_estimator.startswith("reinforce_pp"), "agent_trajectory",
                   "per_call gives each row its episode's advantage, and REINFORCE++'s token returns run along one "
                   "sequence: use agent_trajectory: concatenated or advantage_estimator: grpo / rloo")
            _check(self.environment != "agent" or not self.dynamic_sampling, "dynamic_sampling",
                   "regroups completions by prompt, and an agent writes each episode's prompt itself: set "
                   "dynamic_sampling: false with environment: agent")
            _check(self.environment_timeout > 0 and self.environment_retries >= 1,
                   "environment_timeout/environment_retries", "need a positive timeout and at least one attempt")
        _check_choice(self.episode_source, ("auto", *EPISODE_SOURCES), "episode_source")
        implied = implied_episode_source(self.environment)
        _check(self.episode_source in ("auto", implied) or self.episode_source not in BUILT_IN_EPISODE_SOURCES,
               "episode_source", f"{self.episode_source} does not go with environment {self.environment!r} (which "
               f"samples {implied} episodes): set episode_source: auto")
        _check(not (self.dynamic_sampling and self.streaming), "dynamic_sampling",
               "draws extra prompts at random from the prompt set, which a streaming dataset cannot do: set streaming: "
               "false")
        _check(self.beta >= 0 and self.epsilon_low > 0 and self.epsilon_high > 0, "beta/epsilon_low/epsilon_high",
               "need beta >= 0 and positive clip ranges")
        loss_spec = policy_loss(self.loss_type)  # a registered name, or module:function registering one
        _check_choice(self.scale_rewards, REWARD_SCALES, "scale_rewards")
        _check(self.advantage_estimator != "gae", "advantage_estimator",
               "gae learns a critic: use the ppo stage (grpo, rloo and reinforce_pp are critic-free)")
        _check_choice(self.advantage_estimator, ADVANTAGE_ESTIMATORS, "advantage_estimator")
        _check_choice(self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level")
        _check(not (self.advantage_estimator.startswith("reinforce_pp") and self.scale_rewards != "none"),
               "scale_rewards", f"must be none with advantage_estimator {self.advantage_estimator}: REINFORCE++ "
               f"whitens its token returns over the whole batch instead")
        _check(not (loss_spec.token_level_only and self.importance_sampling_level == "sequence"), "loss_type",
               f"{self.loss_type} clips each token's importance weight: use importance_sampling_level token")
        _check(self.num_iterations >= 1, "num_iterations", "must be >= 1")
        rollout = self.per_device_train_batch_size * self.gradient_accumulation_steps
        _check(rollout % self.num_generations == 0, "per_device_train_batch_size",
               f"times gradient_accumulation_steps ({rollout}) must be a multiple of num_generations "
               f"({self.num_generations}): each step trains on whole groups of completions")
        _check(not (self.ref_model and self.beta == 0), "ref_model",
               "is unused: with beta 0 GRPO has no KL term and loads no reference; remove ref_model, or set beta > 0")

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0


@dataclass
class RLOOConfig(GRPOConfig):
    """RLOO (Ahmadian et al. 2024): GRPO's trainer with leave-one-out baselines, advantages not scaled."""

    advantage_estimator: str = _opt("rloo", "grpo | rloo | reinforce_pp | reinforce_pp_baseline (see the grpo stage)")
    scale_rewards: str = _opt("none", "Divide the advantages by the group's std (group), the batch's (batch) or "
                                      "nothing (none)")

    stage: typing.ClassVar[str] = "rloo"


@dataclass
class ReinforcePPConfig(GRPOConfig):
    """REINFORCE++ (Hu et al. 2025): token returns with the KL to the reference in the reward (beta is its
    coefficient), whitened over the batch; no critic."""

    advantage_estimator: str = _opt("reinforce_pp", "reinforce_pp | reinforce_pp_baseline (group mean first) | grpo | "
                                                    "rloo")
    scale_rewards: str = _opt("none", "Must stay none: REINFORCE++ whitens its returns over the batch")
    beta: float = _opt(0.01, "Coefficient of the per-token KL penalty in the reward (k1 against the reference; 0: "
                             "none)")

    stage: typing.ClassVar[str] = "reinforce_pp"


class GRPOTrainer(_OnlineRLTrainer):
    """GRPO (Shao et al. 2024) with the later refinements TRL users know: each rollout samples
    ``num_generations`` completions per prompt, scores them with the reward functions, turns rewards
    into group-relative advantages, and minimises the clipped objective plus beta * k3 KL.
    ``num_iterations`` > 1 reuses a rollout for several steps against its stored log-probs.
    per_device_train_batch_size counts completions; one step covers batch * accumulation / G prompts."""

    stage = "grpo"

    takes_images = True
    drops_failed_episodes = True

    def __init__(self, config: GRPOConfig, *args: Any, **kwargs: Any) -> None:
        self.stage = config.stage  # grpo, rloo or reinforce_pp: one trainer, the estimator is the config's
        super().__init__(config, *args, **kwargs)

    @property
    def prompts_per_rollout(self) -> int:
        config = self.config
        return config.per_device_train_batch_size * config.gradient_accumulation_steps // config.num_generations

    @property
    def steps_per_rollout(self) -> int:
        return self.config.num_iterations

    @property
    def completions_per_prompt(self) -> int:
        return self.config.num_generations

    @property
    def passes_per_rollout(self) -> int:
        return self.config.num_iterations

    @torch.no_grad()
    def make_rollout(self, prompts: list[dict[str, Any]]) -> Rollout:
        """Sample G completions per prompt, score them, and attach advantages and log-probs."""
        config, group = self.config, self.config.num_generations
        if config.dynamic_sampling:
            episodes, failed, rewards, uninformative, metrics, skip_reason = self._sample_informative_groups(prompts)
        else:
            episodes = self._sample(prompts, group)
            scores = self.scorer.score(episodes, self.rollout_index, self.watchdog.progress)
            # the reward normaliser and batch-scaled advantages see every process's rewards, as one process
            # with the whole batch would; each process keeps its own rows (a prompt's group is on one process)
            rewards, uninformative = self.devices.gather(scores.rewards), None  # (P * B*G)
            failed, skip_reason, metrics = scores.failed.tolist(), scores.skip_reason, {**episodes.metrics,
                                                                                        **scores.metrics}
        grouped_std = rewards.view(-1, group).std(-1)
        metrics.update({"reward_std": float(grouped_std.mean()),
                        "frac_reward_zero_std": float((grouped_std < 1e-6).float().mean())})
        rewards = process_rewards(rewards, normalizer=self.normalizer, clip=config.reward_clip)
        # DAPO: a completion cut off at the length limit says nothing reliable about its reward
        masked = [r == "length" for r in episodes.finish_reasons] if config.mask_truncated_completions else None
        if uninformative is not None:  # dynamic sampling ran out of rounds: those groups stay out of the loss
            masked = [m or u for m, u in zip(masked or [False] * len(uninformative), uninformative)]
        dropped = failed_groups(failed, group)
        if any(dropped):  # an episode without a reward: its group's advantages would be made up, so none trains
            masked = [m or d for m, d in zip(masked or [False] * len(dropped), dropped)]
            metrics["rollout/dropped_groups"] = sum(dropped) / group
        rollout = self._rows(episodes.records, episodes.token_ids, masked, observed=episodes.observation_mask)
        rollout.metrics, rollout.skip_reason = metrics, skip_reason
        token_level = config.advantage_estimator.startswith("reinforce_pp")
        if not token_level:
            advantages = (grpo_advantages(rewards, group, scale=config.scale_rewards)
                          if config.advantage_estimator == "grpo"
                          else _scaled(rloo_advantages(rewards, group), group, config.scale_rewards))
            rollout.advantages = advantages.view(self.devices.num_processes, -1)[self.devices.process_index]
        if episodes.calls is not None:  # an agent's requests, each a row (agent_trajectory)
            rollout, episodes = per_call_rows(episodes, masked, rollout.advantages, self.policy.tokenizer.pad_token_id)
            rollout.metrics, rollout.skip_reason = {**metrics, **episodes.metrics}, skip_reason
        # the trainer's own log-probs are the old ones when a rollout trains several steps, when an engine holding a
        # copy (vLLM, int8) sampled it (one extra forward) unless the engine's are asked for, and for REINFORCE++'s KL
        copy = self.engine.holds_weights
        trainer_old = (config.num_iterations > 1 or (copy and config.vllm_old_logprobs == "trainer")
                       or (token_level and self.reference is not None))
        if trainer_old or self.reference is not None or copy:
            self._attach_log_probs(rollout, episodes, trainer_old)
        if token_level:  # REINFORCE++: the KL to the reference goes into the reward, not the loss
            kl = rollout.old_logps - rollout.ref_logps if rollout.ref_logps is not None else None
            rollout.advantages = reinforce_pp_advantages(
                rewards.view(self.devices.num_processes, -1)[self.devices.process_index], rollout.completion_mask,
                kl=kl, kl_coef=config.beta,
                group_size=group if config.advantage_estimator.endswith("baseline") else None,
                sum_across_processes=self.devices.sum_list_across_processes)
            rollout.ref_logps = None
            if config.num_iterations == 1 and not copy:
                rollout.old_logps = None  # on-policy: the loss needs no stored log-probs
        return rollout

    def _sample_informative_groups(self, prompts: list[dict[str, Any]]
                                   ) -> tuple[Episodes, list[bool], torch.Tensor, list[bool], dict[str, float], str]:
        """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): a group whose completions all scored alike has zero
        advantage and teaches nothing, so it is dropped and more prompts are sampled, drawn at random from the prompt
        set with a generator seeded by the rollout (a resume draws the same), until this rollout holds as many
        informative groups as it has prompts or ``max_sampling_rounds`` rounds have run; processes decide together,
        since scoring gathers across them. Groups still missing are filled with dropped ones, marked to stay out of
        the loss. Returns the kept episodes, which of them failed (none: a group with a failed episode is never kept,
        and fillers are masked anyway), every process's rewards, which completions are such fillers, and the
        metrics (the last round's, the first round's reward: the policy's as sampled, comparable with a run without
        dynamic sampling) and the skip reason of the last round that had one."""
        config, group, needed = self.config, self.config.num_generations, len(prompts)
        draw = torch.Generator().manual_seed(rollout_seed(config.seed, self.rollout_index,
                                                          ROLLOUT_SEED_SALTS["extra_prompts"],
                                                          self.devices.process_index))
        kept: list[tuple] = []  # (episodes of the group, rewards) per informative group
        dropped: list[tuple] = []
        candidates, rounds, sampled, metrics, failures, skip_reason = prompts, 0, 0, {}, 0.0, ""
        while True:
            rounds += 1
            episodes = self._sample(candidates, group)
            scores = self.scorer.score(episodes, self.rollout_index, self.watchdog.progress)
            metrics.update({**episodes.metrics, **scores.metrics})
            failures += scores.metrics["rollout/failed_episodes"]
            skip_reason = scores.skip_reason or skip_reason
            if rounds == 1:
                first_round_reward = scores.metrics["reward"]
            for g in range(len(candidates)):
                rows = range(g * group, (g + 1) * group)
                entry = (episodes.select(rows), scores.rewards[g * group:(g + 1) * group])
                informative = float(entry[1].std()) > 1e-6 and not bool(scores.failed[g * group:(g + 1) * group].any())
                (kept if informative else dropped).append(entry)
            sampled += len(candidates)
            missing = max(0, needed - len(kept))
            if not self.devices.sum_list_across_processes([float(missing)])[0] or rounds >= config.max_sampling_rounds:
                break
            picks = torch.randint(len(self.train_dataset), (max(missing, 1),), generator=draw).tolist()
            candidates = [self.train_dataset[i] for i in picks]
        chosen = kept[:needed] + dropped[:max(0, needed - len(kept))]
        fillers = [i >= len(kept) for i, _ in enumerate(chosen) for _ in range(group)]
        parts = [part for part, _ in chosen]
        observed = [m for part in parts for m in part.observation_mask] if parts[0].observation_mask else None
        episodes = Episodes([t for p in parts for t in p.token_ids], [lp for p in parts for lp in p.logprobs],
                            [r for p in parts for r in p.finish_reasons], [r for p in parts for r in p.records],
                            observation_mask=observed)
        rewards = self.devices.gather(torch.cat([rewards for _, rewards in chosen]))
        metrics.update({"dynamic_sampling/rounds": float(rounds),
                        "dynamic_sampling/dropped_frac": 1.0 - len(kept) / max(sampled, 1),
                        "dynamic_sampling/filler_frac": sum(fillers) / max(len(fillers), 1),
                        "rollout/failed_episodes": failures, "reward": first_round_reward,
                        "dynamic_sampling/kept_reward": float(rewards.mean())})
        return episodes, episodes.failed, rewards, fillers, metrics, skip_reason

    def _attach_log_probs(self, rollout: Rollout, episodes: Episodes, trainer_old: bool) -> None:
        """The rollout's old log-probs (a forward of the policy as it sampled), reference log-probs, and from an
        engine holding a copy (vLLM, fp16, int8) the engine/trainer correction."""
        config = self.config
        parts = [self._to_device(b) for b in rollout.micro_batches(config.per_device_train_batch_size,
                                                                   vision=self.policy.vision)]
        sampled: list[torch.Tensor] = []
        with self.devices.autocast():
            if trainer_old:
                rollout.old_logps = torch.cat([self._policy_logps(b, sampled).cpu() for b in parts])
            if self.reference is not None:
                rollout.ref_logps = torch.cat([self._reference_logps(b).cpu() for b in parts])
        if self.engine.holds_weights:
            self._engine_correction(rollout, episodes, torch.cat(sampled) if sampled else None)

    def rollout_schedule(self, rollout: Rollout) -> list[dict[str, torch.Tensor]]:
        config = self.config
        planned = config.per_device_train_batch_size * config.gradient_accumulation_steps
        chunks = config.gradient_accumulation_steps if rollout.input_ids.shape[0] != planned else None  # per_call
        return (rollout.micro_batches(config.per_device_train_batch_size, vision=self.policy.vision, chunks=chunks)
                * config.num_iterations)

    @property
    def shares_prompts(self) -> bool:
        """Whether forwards run each group's prompt once (grouped_prefix_logits) instead of per row."""
        return (self.config.share_prompt and not self.config.gradient_checkpointing and self.policy.vision is None
                and self.policy.model.config.model_type not in PREFIX_SHARING_EXCLUDED)

    def _all_processes_agree(self, choice: bool) -> bool:
        """True when ``choice`` is True on every process (one small all-reduce)."""
        return self.devices.sum_across_processes(float(choice)) == self.devices.num_processes

    def _scores(self, model: PolicyModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """OutputHead scores of the positions that predict the next token. Shapes: -> (N, T-1, V|H)."""
        if self.shares_prompts and batch.get("prompt_lengths") is not None:
            return grouped_logits(model.model, batch["input_ids"], batch["attention_mask"], batch["prompt_lengths"],
                                  pad_token_id=self.policy.tokenizer.pad_token_id, pack=self.config.padding_free,
                                  agree=self._all_processes_agree if self.devices.num_processes > 1 else None)
        scores, _ = OutputHead.of(model).scores(model, input_ids=batch["input_ids"],
                                                attention_mask=batch["attention_mask"], **vision_kwargs(batch))
        return scores[:, :-1]

    def _logps(self, model: PolicyModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Temperature-scaled log-probs of each next token, as sampled. Shapes: -> (N, T-1)."""
        return OutputHead.of(model).log_probs(self._scores(model, batch), batch["input_ids"][:, 1:],
                                              self.config.temperature)

    def _reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.reference._frozen():
            return self._logps(self.reference.model, batch)

    def _policy_logps(self, batch: dict[str, torch.Tensor], sampled: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The policy's log-probs; with ``sampled``, also appends (on the CPU) those under the distribution the
        rollout engine sampled from, from the same forward."""
        scores = self._scores(self.forward_policy, batch)
        logps = OutputHead.of(self.policy).log_probs(scores, batch["input_ids"][:, 1:], self.config.temperature)
        if sampled is not None:
            sampled.append(self._trainer_sampled_logps(scores, batch["input_ids"], logps).cpu())
        return logps

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        """What the loss's aggregation normalises by (LOSS_AGGREGATIONS): sequences, completion tokens, ..."""
        aggregation = LOSS_AGGREGATIONS[policy_loss(self.config.loss_type).aggregation]
        tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        return aggregation.units(batch["input_ids"].shape[0], tokens, self.config.max_completion_length)

    def _rows_that_train(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
        """The micro-batch without the rows whose gradient is exactly zero, and the share of its completion
        tokens the kept rows hold. Without a KL term a row adds -A * rho per token, so a row with advantage 0
        (every completion of its group scored alike: DAPO, Yu et al. 2025 sec. 3.2, filters such groups) or
        with no completion token in the loss adds nothing to the loss or its gradient, and its forward and
        backward can be skipped without changing the update. One row stays when none would, so every
        process still runs a forward and backward and their collectives stay in step."""
        if not self.config.skip_zero_gradient_rows or batch.get("ref_logps") is not None or "pixel_values" in batch:
            return batch, 1.0  # (pixel inputs are per image, not per row: an image batch keeps its rows)
        tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1)
        advantages = batch["advantages"]
        trains = (advantages != 0 if advantages.dim() == 1 else (advantages != 0).any(-1)) & (tokens > 0)
        if bool(trains.all()):
            return batch, 1.0
        keep = (trains.nonzero().squeeze(-1) if bool(trains.any())
                else torch.zeros(1, dtype=torch.long, device=trains.device))
        share = float(tokens[keep].sum()) / max(float(tokens.sum()), 1.0)
        return {k: v[keep] for k, v in batch.items()}, share

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        config = self.config
        rows = batch["input_ids"].shape[0]
        batch, token_share = self._rows_that_train(batch)
        batch = _trim_columns(batch)
        head = OutputHead.of(self.policy)
        scores = self._scores(self.forward_policy, batch)
        mask = batch["labels"][:, 1:] != IGNORE_INDEX  # (N, T-1)
        per_token = head.log_probs(scores, batch["input_ids"][:, 1:], config.temperature)
        loss, metrics = grpo_loss(per_token, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], mask,
                                  epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high, beta=config.beta,
                                  loss_type=config.loss_type, max_completion_length=config.max_completion_length,
                                  importance_weights=batch.get("importance_weights"),
                                  importance_sampling_level=config.importance_sampling_level)
        metrics["entropy"] = float(_masked_mean(head.entropy(scores.detach(), config.temperature), mask.float()))
        metrics["skipped_rows_frac"] = 1.0 - batch["input_ids"].shape[0] / rows
        # every aggregation but a micro-batch mean returns a sum over rows or tokens (times loss_units), which the
        # skipped rows add nothing to; bnpo's token mean is over the whole micro-batch: rescaled to that many tokens
        if LOSS_AGGREGATIONS[policy_loss(config.loss_type).aggregation].per_micro_batch:
            loss = loss * token_share
        return loss * self.loss_units(batch), metrics


@_leaves_logging_as_found
def train_grpo(config: GRPOConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run the GRPO stage (and rloo, reinforce_pp): reward functions from the config (RewardFunctionFactory), prompts,
    rollouts."""
    return _train_online_stage(config, devices, GRPOTrainer)


# one trainer for the three critic-free estimators; the config picks advantage_estimator
register_stage(Stage("grpo", GRPOConfig, train_grpo, GRPOTrainer, record_kind="prompt"))
register_stage(Stage("rloo", RLOOConfig, train_grpo, GRPOTrainer, record_kind="prompt"))
register_stage(Stage("reinforce_pp", ReinforcePPConfig, train_grpo, GRPOTrainer, record_kind="prompt"))


@releases_output_dir
def _train_online_stage(config: OnlineRLConfig, devices: DeviceManager | None, trainer_class: type) -> TrainResult:
    """What an online stage scored by reward functions runs: records, the rewards (a bad reward spec fails before
    the policy loads), the policy, its prompts, a reference when the config uses one, the trainer."""
    records, devices = _start_stage(config, devices)
    _check_reward_answers(config, records[0])
    reward_fn = RewardFunctionFactory(config, devices.device).build()
    policy = _load_trained_policy(config, devices)
    formatter = chat_formatter(policy.tokenizer, config, policy)
    train, eval_records = _prompt_datasets(config, records, policy.tokenizer, formatter, devices)
    reference = create_reference_model(config, policy)
    return trainer_class(config, policy, train, reward_fn=reward_fn, reference=reference, eval_records=eval_records,
                         formatter=formatter, devices=devices).train()


# ---- Online DPO ----
#   config: OnlineDPOConfig (below; on OnlineRLConfig, section 1); rewards: RewardFunctionFactory (section 8)
#   runner: train_online_dpo; registered by register_stage after it
#   trainer: OnlineDPOTrainer.make_rollout (two samples per prompt, ranked) -> compute_loss
#   loss: dpo_loss / PREFERENCE_LOSSES, simpo_loss (section 7)


@dataclass
class OnlineDPOConfig(OnlineRLConfig):
    """Online DPO (Guo et al. 2024, "Direct language model alignment from online AI feedback"): two samples per
    prompt from the current policy, ranked by the reward functions, trained with a DPO-family loss."""

    pref_beta: float = _opt(0.1, "beta of the DPO-family loss (SimPO: reward scale, e.g. 2.0)")
    pref_loss: str = _opt("sigmoid", "Loss on each ranked pair: " + " | ".join(DPO_LOSS_TYPES) + " | simpo")
    dpo_label_smoothing: float = _opt(0.0, "Label-flip rate for cDPO / robust / exo (0 to 0.5)")
    simpo_gamma: float = _opt(0.5, "SimPO target reward margin gamma")

    stage: typing.ClassVar[str] = "online_dpo"

    def _validate(self) -> None:
        super()._validate()
        _check(self.pref_loss != "orpo", "pref_loss", "orpo is not offered online: use sigmoid (DPO) or simpo")
        _check_choice(self.pref_loss, DPO_LOSS_TYPES + ("simpo",), "pref_loss")
        _check(self.pref_beta > 0, "pref_beta", "must be > 0")
        _check(0 <= self.dpo_label_smoothing < 0.5, "dpo_label_smoothing", "must be in [0, 0.5)")

    @property
    def uses_reference(self) -> bool:
        return self.pref_loss != "simpo"


class OnlineDPOTrainer(_OnlineRLTrainer):
    """Online DPO (Guo et al. 2024; TRL's OnlineDPOTrainer): each step samples two completions per prompt from
    the current policy, ranks them with the reward functions (a reward model, rules or an API judge), and trains
    the DPO-family loss on the ranked pair against the reference. A pair scored alike carries no preference and
    stays out of the loss. per_device_train_batch_size counts pairs (prompts)."""

    stage = "online_dpo"
    completions_per_prompt = 2
    steps_per_rollout = 1
    passes_per_rollout = 1

    @property
    def prompts_per_rollout(self) -> int:
        return self.config.per_device_train_batch_size * self.config.gradient_accumulation_steps

    @torch.no_grad()
    def make_rollout(self, prompts: list[dict[str, Any]]) -> Rollout:
        """Rows ordered so that each micro-batch holds its pairs' chosen rows, then their rejected ones."""
        size = self.config.per_device_train_batch_size
        episodes = self._sample(prompts, 2)
        ranked = self.scorer.score_completions(episodes.records, episodes.token_ids, self.watchdog.progress)
        scores = ranked.rewards.view(-1, 2)  # (B, 2)
        second = (scores[:, 1] > scores[:, 0]).long()
        chosen, rejected = torch.arange(len(prompts)) * 2 + second, torch.arange(len(prompts)) * 2 + 1 - second
        order = torch.cat([torch.cat([chosen[i:i + size], rejected[i:i + size]]) for i in range(0, len(prompts), size)])
        episodes = episodes.select(order.tolist())
        rollout = self._rows(episodes.records, episodes.token_ids)
        decided = (scores[:, 0] != scores[:, 1]).float()
        rollout.pair_weights = torch.cat([decided[i:i + size].repeat(2) for i in range(0, len(prompts), size)])
        rollout.skip_reason = ranked.skip_reason
        rollout.metrics = {**episodes.metrics, **ranked.metrics,
                           "online_dpo/ties_frac": 1.0 - float(decided.mean()),
                           "online_dpo/score_margin": float((scores.max(-1).values - scores.min(-1).values).mean())}
        if self.reference is not None:
            with self.devices.autocast():
                rollout.ref_summed = torch.cat([_reference_logps(self.reference,
                                                                 _trim_columns(self._to_device(b))).cpu()
                                                for b in rollout.micro_batches(2 * size)])
        if self.engine.holds_weights:  # the correction has no place in a sequence-level loss: report the gap only
            rollout.metrics.update(self._engine_gap(rollout, episodes))
        return rollout

    def rollout_schedule(self, rollout: Rollout) -> list[dict[str, torch.Tensor]]:
        return rollout.micro_batches(2 * self.config.per_device_train_batch_size)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        config = self.config
        batch = _trim_columns(batch)
        out = _completion_forward(self.forward_policy, batch)
        weights = batch["pair_weights"].chunk(2)[0]
        if config.pref_loss == "simpo":
            chosen_avg, rejected_avg = out.averaged.chunk(2)
            losses, chosen_rewards, rejected_rewards = simpo_loss(chosen_avg, rejected_avg, beta=config.pref_beta,
                                                                  gamma=config.simpo_gamma,
                                                                  label_smoothing=config.dpo_label_smoothing)
        else:
            policy_chosen, policy_rejected = out.summed.chunk(2)
            ref_chosen, ref_rejected = batch["ref_summed"].chunk(2)
            chosen_lengths, rejected_lengths = out.lengths.chunk(2)
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=config.pref_beta,
                loss_type=config.pref_loss, label_smoothing=config.dpo_label_smoothing,
                chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
        ranked = weights.bool()
        metrics = {"rewards/chosen": float(chosen_rewards[ranked].mean()) if ranked.any() else 0.0,
                   "rewards/margins": float((chosen_rewards - rejected_rewards)[ranked].mean())
                   if ranked.any() else 0.0,
                   "rewards/accuracies": float((chosen_rewards > rejected_rewards)[ranked].float().mean())
                   if ranked.any() else 0.0}
        return (losses * weights).sum(), metrics


@_leaves_logging_as_found
def train_online_dpo(config: OnlineDPOConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run the online DPO stage: reward functions rank two fresh samples per prompt."""
    return _train_online_stage(config, devices, OnlineDPOTrainer)


register_stage(Stage("online_dpo", OnlineDPOConfig, train_online_dpo, OnlineDPOTrainer, record_kind="prompt"))


# ---- On-policy distillation (GKD) ----
#   config: DistillConfig (below; on OnlineRLConfig, section 1)
#   runner: train_distill; registered by register_stage after it
#   trainer: DistillTrainer.make_rollout (student, teacher or dataset responses) -> compute_loss
#   loss: generalized_jsd_loss (section 7)


@dataclass
class DistillConfig(OnlineRLConfig):
    """On-policy distillation (GKD, Agarwal et al. 2024): the student learns the teacher's token distributions on
    its own samples (a share lmbda of the steps) and on the dataset's responses (or the teacher's, seq_kd)."""

    teacher_model: str | None = _opt(None, "The teacher: a model directory with the student's tokenizer (never "
                                           "trained)")
    teacher_model_dtype: str = _opt("auto", "The teacher's dtype: auto (as the student's base) | float32 | bfloat16 | "
                                            "float16")
    lmbda: float = _opt(0.5, "Share of steps that train on the student's own samples (on-policy); the rest on the "
                             "dataset's responses")
    beta: float = _opt(0.5, "Generalised Jensen-Shannon interpolation: 0 forward KL(teacher || student), 1 reverse "
                            "KL(student || teacher)")
    seq_kd: bool = _opt(False, "Off-policy steps train on the teacher's own samples instead of the dataset's responses "
                               "(sequence-level KD)")

    stage: typing.ClassVar[str] = "distill"
    scored_by_rewards: typing.ClassVar[bool] = False
    uses_reference: typing.ClassVar[bool] = False

    def _validate(self) -> None:
        super()._validate()
        _check(bool(self.teacher_model), "teacher_model", "is required: the model to distil from (a directory)")
        _check(0 <= self.lmbda <= 1 and 0 <= self.beta <= 1, "lmbda/beta", "must each lie in [0, 1]")
        _check_choice(self.teacher_model_dtype, ("auto", "float32", "bfloat16", "float16"), "teacher_model_dtype")
        _check(not self.streaming, "streaming", "is not offered for distill yet: set streaming: false")


class DistillTrainer(_OnlineRLTrainer):
    """GKD (Agarwal et al. 2024; TRL's GKDTrainer): each step's responses are, with probability lmbda, the
    student's own samples (on-policy: the student learns from its own mistakes), else the dataset's responses or
    with seq_kd the teacher's samples; the loss is the generalised Jensen-Shannon divergence between the teacher's
    and the student's next-token distributions on every response token. The teacher is frozen."""

    stage = "distill"
    completions_per_prompt = 1
    steps_per_rollout = 1
    passes_per_rollout = 1

    def __init__(self, config: DistillConfig, policy: PolicyModel, train_dataset: Any, *, teacher: PolicyModel,
                 eval_records: list[dict[str, Any]] | None = None, formatter: ChatFormatter | None = None,
                 devices: DeviceManager | None = None) -> None:
        check_same_vocabulary(teacher.tokenizer, policy.tokenizer, "teacher_model")
        super().__init__(config, policy, train_dataset, reward_fn=None, eval_records=eval_records, formatter=formatter,
                         devices=devices)
        self.teacher = teacher.to(self.devices.device).eval().requires_grad_(False)

    @property
    def prompts_per_rollout(self) -> int:
        return self.config.per_device_train_batch_size * self.config.gradient_accumulation_steps

    @torch.no_grad()
    def make_rollout(self, prompts: list[dict[str, Any]]) -> Rollout:
        config = self.config
        draw = torch.Generator().manual_seed(rollout_seed(config.seed, self.rollout_index))  # a resume draws alike
        on_policy = float(torch.rand((), generator=draw)) < config.lmbda
        metrics = {}
        if on_policy:
            episodes = self._sample(prompts, 1)
            completions, metrics = episodes.token_ids, episodes.metrics
        elif config.seq_kd:
            completions = self._teacher_samples(prompts)
        else:
            completions = [self.formatter.prompt_and_completion(p, p["response"])[1] for p in prompts]
        rollout = self._rows(prompts, completions)
        rollout.metrics = {**metrics, "distill/on_policy": float(on_policy)}
        return rollout

    def _teacher_samples(self, prompts: list[dict[str, Any]]) -> list[list[int]]:
        params = self._sampling_params(1, self.rollout_index)  # seeded by the rollout: a resume samples alike
        params = dataclasses.replace(params, seed=params.seed if params.seed is not None else
                                     rollout_seed(self.config.seed, self.rollout_index))
        return generate_tokens(self.teacher.model, [p["prompt_ids"] for p in prompts], params,
                               pad_token_id=self.policy.tokenizer.pad_token_id).token_ids

    def rollout_schedule(self, rollout: Rollout) -> list[dict[str, torch.Tensor]]:
        return rollout.micro_batches(self.config.per_device_train_batch_size)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        config = self.config
        batch = _trim_columns(batch)
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        student = self.forward_policy.model(**inputs).logits[:, :-1]
        with torch.no_grad():
            teacher = self.teacher.model(**inputs).logits[:, :-1]
        vocab = len(self.policy.tokenizer)  # either model may pad its output layer past the shared vocabulary
        mask = (batch["labels"][:, 1:] != IGNORE_INDEX).float()
        per_token = generalized_jsd_loss(student[..., :vocab], teacher[..., :vocab], beta=config.beta,
                                         temperature=config.temperature)
        metrics = {"distill/divergence": float(_masked_mean(per_token.detach(), mask))}
        return (per_token * mask).sum(), metrics


def check_same_vocabulary(teacher_tokenizer: Any, student_tokenizer: Any, field_name: str) -> None:
    """Distillation compares token distributions position by position: both models must share the tokenizer."""
    teacher, student = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if teacher != student:
        differ = len(set(teacher.items()) ^ set(student.items()))
        raise RLHFInputError(f"config field '{field_name}': its tokenizer differs from the student's ({len(teacher)} "
                             f"vs {len(student)} tokens, {differ} entries differ); distillation compares the two "
                             "models' next-token distributions, so the teacher must use the student's tokenizer")


@_leaves_logging_as_found
@releases_output_dir
def train_distill(config: DistillConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run the distill stage: the student (model_name_or_path) learns the teacher's distributions."""
    (train_records, _, eval_records), devices = _start_stage(config, devices)
    policy = _load_trained_policy(config, devices)
    dtype = _model_dtype(config) if config.teacher_model_dtype == "auto" else config.teacher_model_dtype
    teacher = PolicyModel.from_pretrained(config.teacher_model, dtype=dtype,
                                          attn_implementation=config.attn_implementation,
                                          trust_remote_code=config.trust_remote_code, device=devices.device,
                                          cache_dir=config.cache_dir, is_trainable=False, field="teacher_model")
    formatter = chat_formatter(policy.tokenizer, config, policy)
    train = DistillDataset(train_records, policy.tokenizer, formatter, cutoff_len=config.cutoff_len)
    eval_prompts = [{**r, "messages": r["messages"][:-1]} if r["messages"][-1].get("role") == "assistant" else r
                    for r in eval_records or []]
    return DistillTrainer(config, policy, train, teacher=teacher, eval_records=eval_prompts, formatter=formatter,
                          devices=devices).train()


# distillation reads SFT records: prompts, and dataset responses when lmbda < 1
register_stage(Stage("distill", DistillConfig, train_distill, DistillTrainer, record_kind="sft"))


# ---- PPO ----
#   config: PPOConfig (below; on OnlineRLConfig, section 1); rewards: RewardFunctionFactory (section 8)
#   runner: train_ppo; registered by register_stage after it
#   trainer: PPOTrainer.make_rollout (KL penalty, compute_gae) -> compute_loss
#   loss: ppo_policy_loss + ppo_value_loss; AdaptiveKLController / FixedKLController (section 7)


@dataclass
class PPOConfig(OnlineRLConfig):
    """PPO with a learned critic (Ziegler et al. 2019, Ouyang et al. 2022): per-token KL penalty in the
    reward, GAE advantages, clipped policy and value losses; LLaMA-Factory's ppo_* options."""

    ppo_epochs: int = _opt(4, "Passes over each experience buffer")
    ppo_buffer_size: int = _opt(1, "Mini-batches (per_device_train_batch_size x gradient_accumulation_steps "
                                   "completions each) per experience buffer")
    ppo_target: float = _opt(6.0, "Target KL (nats per sequence) of the adaptive KL controller")
    ppo_score_norm: bool = _opt(False, "Normalise scores by their running mean/std")
    ppo_whiten_rewards: bool = _opt(False, "Whiten the per-token rewards (keeping their mean) before GAE")
    init_kl_coef: float = _opt(0.2, "Initial coefficient of the per-token KL penalty")
    adap_kl_ctrl: bool = _opt(True, "Adapt the KL coefficient towards ppo_target (false: a fixed coefficient)")
    kl_horizon: int = _opt(10000, "Horizon (in sequences) of the adaptive KL controller")
    gamma: float = _opt(1.0, "Discount factor of GAE")
    lam: float = _opt(0.95, "GAE lambda")
    cliprange: float = _opt(0.2, "Clip range of the policy probability ratio")
    cliprange_value: float = _opt(0.2, "Clip range of the value prediction around its rollout value")
    vf_coef: float = _opt(0.1, "Weight of the value loss")
    entropy_coef: float = _opt(0.0, "Weight of the entropy bonus")
    whiten_advantages: bool = _opt(True, "Whiten advantages over each experience buffer")
    value_model: str | None = _opt(None, "Separate critic: a model directory (e.g. the reward model). Default: a value "
                                         "head on the policy's backbone")

    stage: typing.ClassVar[str] = "ppo"
    uses_reference: typing.ClassVar[bool] = True

    def _validate(self) -> None:
        super()._validate()
        for name in ("ppo_epochs", "ppo_buffer_size", "ppo_target", "kl_horizon", "cliprange", "cliprange_value"):
            _check(getattr(self, name) > 0, name, "must be > 0")
        for name in ("init_kl_coef", "vf_coef", "entropy_coef"):
            _check(getattr(self, name) >= 0, name, "must be >= 0")
        _check(0 < self.gamma <= 1 and 0 <= self.lam <= 1, "gamma/lam", "need 0 < gamma <= 1 and 0 <= lam <= 1")


class RolloutBuffer:
    """PPO's experience buffer: one rollout of ``ppo_buffer_size`` mini-batches, replayed for
    ``epochs`` passes, each pass in a fresh order drawn from ``seed`` and cut into micro-batches;
    consecutive micro-batches of one mini-batch are accumulated into one optimizer step."""

    def __init__(self, rollout: Rollout, *, micro_batch_size: int, epochs: int, seed: int) -> None:
        self.rollout, self.micro_batch_size, self.epochs, self.seed = rollout, micro_batch_size, epochs, seed

    def __len__(self) -> int:
        return self.epochs * math.ceil(self.rollout.input_ids.shape[0] / self.micro_batch_size)

    def micro_batches(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for epoch in range(self.epochs):
            order = torch.randperm(self.rollout.input_ids.shape[0],
                                   generator=torch.Generator().manual_seed(self.seed + epoch))
            out += self.rollout.micro_batches(self.micro_batch_size, order)
        return out


class PPOTrainer(_OnlineRLTrainer):
    """PPO for language models (Ziegler et al. 2019; Ouyang et al. 2022), as TRL and LLaMA-Factory run it:
    one completion per prompt; the score from the reward functions lands on the last completion
    token, every token pays -kl_coef * (logp - ref_logp); GAE over the critic's values gives
    advantages; ``ppo_epochs`` passes over shuffled mini-batches minimise the clipped policy loss
    plus vf_coef * the clipped value loss minus entropy_coef * entropy. The KL coefficient adapts
    towards ``ppo_target`` (or stays fixed). An experience buffer holds ppo_buffer_size mini-batches."""

    stage = "ppo"

    def __init__(self, config: PPOConfig, policy: PolicyModel, train_dataset: Any, *, reward_fn: RewardFn,
                 reference: ReferenceModel | None = None, critic: ValueModel | None = None,
                 eval_records: list[dict[str, Any]] | None = None, formatter: ChatFormatter | None = None,
                 devices: DeviceManager | None = None) -> None:
        self.critic = critic or ValueModel(text_config(policy.model).hidden_size, seed=config.seed)
        self.kl_controller = (AdaptiveKLController(config.init_kl_coef, config.ppo_target, config.kl_horizon)
                              if config.adap_kl_ctrl else FixedKLController(config.init_kl_coef))
        super().__init__(config, policy, train_dataset, reward_fn=reward_fn, reference=reference,
                         eval_records=eval_records, formatter=formatter, devices=devices)

    def _normalise_rewards(self, config: PPOConfig) -> bool:
        return config.reward_normalize or config.ppo_score_norm

    @property
    def prompts_per_rollout(self) -> int:
        config = self.config
        return config.per_device_train_batch_size * config.gradient_accumulation_steps * config.ppo_buffer_size

    @property
    def steps_per_rollout(self) -> int:
        return self.config.ppo_epochs * self.config.ppo_buffer_size

    completions_per_prompt = 1

    @property
    def passes_per_rollout(self) -> int:
        return self.config.ppo_epochs

    def _setup_model(self) -> None:
        self.policy.prepare_for_training(self.config)
        if self.critic.backbone is not None:  # a separate critic is fine-tuned the way the policy is
            if self.config.finetuning_type == "full":
                self.critic.backbone.requires_grad_(True)
            self.critic.backbone = _prepare_backbone(self.critic.backbone, self.config)
        self.critic.head.requires_grad_(True)
        if self.config.disable_dropout:  # the backbones' own dropout went in _prepare_backbone; this is the head's
            disable_dropout(self.critic)
        self.actor_critic = ActorCritic(self.policy.model, self.critic).to(self.devices.device)
        self.model = self._prepared(self.actor_critic)

    def _after_prepare(self) -> None:  # the actor-critic trains through its own forward: no policy view
        self._setup_sharding()
        self.model.train()

    def _forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Temperature-scaled log-probs of each next token, the OutputHead scores they come from and the values,
        for positions that predict the next token. Shapes: (N, T-1), (N, T-1, V|H), (N, T-1)."""
        scores, values = self.model(batch["input_ids"], batch["attention_mask"])
        scores = scores[:, :-1]
        logps = OutputHead.of(self.policy).log_probs(scores, batch["input_ids"][:, 1:], self.config.temperature)
        return logps, scores, values[:, :-1].float()

    @torch.no_grad()
    def make_rollout(self, prompts: list[dict[str, Any]]) -> Rollout:
        config = self.config
        episodes = self._sample(prompts, 1)
        scored = self.scorer.score_completions(prompts, episodes.token_ids, self.watchdog.progress)
        scores = scored.rewards
        # the running normaliser sees every process's scores, so all processes normalise alike
        everyone = process_rewards(self.devices.gather(scores), normalizer=self.normalizer, clip=config.reward_clip)
        scores = everyone.view(self.devices.num_processes, -1)[self.devices.process_index]
        rollout = self._rows(prompts, episodes.token_ids)
        rollout.metrics, rollout.skip_reason = {**episodes.metrics, **scored.metrics}, scored.skip_reason
        logps, values, ref_logps, sampled = [], [], [], []
        for batch in rollout.micro_batches(config.per_device_train_batch_size):
            batch = self._to_device(batch)
            with self.devices.autocast():
                logp, head_scores, value = self._forward(batch)
                logps.append(logp.cpu())
                values.append(value.cpu())
                ref_logps.append(self._reference_logps(batch).cpu())
                if self.engine.holds_weights:
                    sampled.append(self._trainer_sampled_logps(head_scores, batch["input_ids"], logp).cpu())
        rollout.old_logps, rollout.old_values, rollout.ref_logps = (torch.cat(logps), torch.cat(values),
                                                                    torch.cat(ref_logps))
        if self.engine.holds_weights:
            self._engine_correction(rollout, episodes, torch.cat(sampled))
        mask = rollout.completion_mask.float()
        kl = (rollout.old_logps - rollout.ref_logps) * mask  # k1 estimate per token (Ziegler et al. 2019 eq. 2)
        kl_coef = self.kl_controller.value
        rewards = -kl_coef * kl
        last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # each row's last completion token
        rewards[torch.arange(len(scores)), last] += scores
        everywhere = self.devices.sum_list_across_processes  # whiten with the whole batch's moments, on every process
        if config.ppo_whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False, sum_across_processes=everywhere) * mask
        advantages, rollout.returns = compute_gae(rewards, rollout.old_values, mask, gamma=config.gamma, lam=config.lam)
        if config.whiten_advantages:
            rollout.advantages = whiten(advantages, mask, sum_across_processes=everywhere) * mask
        else:
            rollout.advantages = advantages
        sequence_kl = kl.sum(-1)
        rollout.metrics.update({
            "objective/kl": float(sequence_kl.mean()), "objective/kl_coef": kl_coef,
            "objective/scores": float(scores.mean()),
            "objective/rlhf_reward": float((scores - kl_coef * sequence_kl).mean()),
            "returns/mean": float(_masked_mean(rollout.returns, mask)),
            "values/mean": float(_masked_mean(rollout.old_values, mask))})
        # one KL coefficient for all processes: the controller steps on the KL of the whole batch
        kl_sum, count = self.devices.sum_list_across_processes([float(sequence_kl.mean()) * len(scores), len(scores)])
        self.kl_controller.update(kl_sum / count, int(count))
        return rollout

    def rollout_schedule(self, rollout: Rollout) -> list[dict[str, torch.Tensor]]:
        """ppo_epochs passes over the experience buffer, each in a fresh order seeded by the rollout's index."""
        config = self.config
        return RolloutBuffer(rollout, micro_batch_size=config.per_device_train_batch_size, epochs=config.ppo_epochs,
                             seed=buffer_order_seed(config.seed, self.rollout_index)).micro_batches()

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        config = self.config
        batch = _trim_columns(batch)
        logps, scores, values = self._forward(batch)
        mask = batch["labels"][:, 1:] != IGNORE_INDEX
        policy_loss, metrics = ppo_policy_loss(logps, batch["old_logps"], batch["advantages"], mask,
                                               clip_range=config.cliprange,
                                               importance_weights=batch.get("importance_weights"))
        value_loss = ppo_value_loss(values, batch["old_values"], batch["returns"], mask,
                                    clip_range_value=config.cliprange_value)
        # the entropy bonus needs its gradient only when it is in the loss
        entropy_scores = scores if config.entropy_coef else scores.detach()
        entropy = _masked_mean(OutputHead.of(self.policy).entropy(entropy_scores, config.temperature), mask.float())
        loss = policy_loss + config.vf_coef * value_loss - config.entropy_coef * entropy
        value_clipped = (values - batch["old_values"]).abs() > config.cliprange_value
        metrics.update({"loss/policy": float(policy_loss.detach()), "loss/value": float(value_loss.detach()),
                        "entropy": float(entropy.detach()),
                        "value/clipfrac": float(_masked_mean(value_clipped.float(), mask.float()))})
        return loss * self.loss_units(batch), metrics

    # -- checkpoints: the critic is saved beside the policy
    policy_prefix = "policy."  # ActorCritic's

    def _save_model(self, directory: Path) -> None:
        super()._save_model(directory)
        critic = self.devices.unwrap(self.model).critic
        critic_state = state_under(self.gathered_weights, "critic.")
        if critic.shares_policy_backbone:
            critic.save_pretrained(directory, state_dict=critic_state)
        else:
            critic.save_pretrained(directory / "critic", self.policy.tokenizer, state_dict=critic_state)

    def _load_model(self, directory: Path) -> None:
        super()._load_model(directory)
        critic = self.devices.unwrap(self.model).critic
        if critic.shares_policy_backbone:
            critic.load_head(directory)
        else:
            load_weights_into(critic.backbone, directory / "critic")
            critic.load_head(directory / "critic")

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(), "kl_coef": self.kl_controller.value}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        super()._load_extra_state(state)
        if "kl_coef" in state:
            self.kl_controller.value = state["kl_coef"]


@_leaves_logging_as_found
@releases_output_dir
def train_ppo(config: PPOConfig, devices: DeviceManager | None = None) -> TrainResult:
    """Run the PPO stage: reward functions, a critic (value head on the policy, or value_model), a reference."""
    records, devices = _start_stage(config, devices)
    _check_reward_answers(config, records[0])
    reward_fn = RewardFunctionFactory(config, devices.device).build()
    policy = _load_trained_policy(config, devices)
    critic = None
    if not (config.value_model or config.ppo_score_norm) and config.finetuning_type == "full" and config.vf_coef > 0:
        # Why warn: the critic's regression on raw scores can outweigh the policy term and retrain the shared
        # body, so the policy loses accuracy it had
        logger.warning("PPO: the value head shares the policy's fully fine-tuned backbone (LLaMA-Factory's layout), "
                       "so the value loss also trains the language model and can cost it accuracy; give "
                       "value_model=DIR (a separate critic, e.g. the reward model, as InstructGPT and TRL do) or "
                       "ppo_score_norm=true to keep the value targets small")
    if config.value_model:
        critic, _ = ValueModel.from_pretrained(config.value_model, device=devices.device, seed=config.seed,
                                               dtype=_model_dtype(config),
                                               attn_implementation=config.attn_implementation,
                                               trust_remote_code=config.trust_remote_code, cache_dir=config.cache_dir,
                                               quantization=quantization_config(config))
    formatter = chat_formatter(policy.tokenizer, config, policy)
    train, eval_records = _prompt_datasets(config, records, policy.tokenizer, formatter, devices)
    reference = create_reference_model(config, policy)
    return PPOTrainer(config, policy, train, reward_fn=reward_fn, reference=reference, critic=critic,
                      eval_records=eval_records, formatter=formatter, devices=devices).train()


register_stage(Stage("ppo", PPOConfig, train_ppo, PPOTrainer, record_kind="prompt"))

# The registered stages as an enum (what logs, report entries and checkpoints carry: BaseTrainer sets its
# stage to one); it prints, formats and serialises as the plain name.
TrainingStage = _StageName("TrainingStage", [(name.upper(), name) for name in STAGES])


# ==== 11. Evaluation ====


def kl_estimates(policy_log_probs: torch.Tensor, reference_log_probs: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, float]:
    """KL(policy || reference) from completions sampled from the policy, with Schulman's (2020)
    estimators per token, r = pi_ref(x) / pi(x): k1 = -log r (unbiased, can be negative per sample)
    and k3 = (r - 1) - log r (unbiased and always >= 0, lower variance). Each sequence's KL is the sum
    over its tokens; returned are the means over sequences.
    Shapes: log-probs and mask (B, T) -> {"kl/k1", "kl/k3", "kl/k1_std"}."""
    log_ratio = (reference_log_probs - policy_log_probs).float().clamp(-20.0, 20.0) * mask
    k1 = (-log_ratio).sum(-1)
    k3 = ((log_ratio.exp() - 1.0 - log_ratio) * mask).sum(-1)
    return {"kl/k1": float(k1.mean()), "kl/k3": float(k3.mean()),
            "kl/k1_std": float(k1.std()) if k1.numel() > 1 else 0.0}


def _ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    words = text.split()
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct-n (Li et al. 2016): distinct word n-grams over all n-grams of all texts (0 when none)."""
    grams = [gram for text in texts for gram in _ngrams(text, n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def self_similarity(samples: list[str], n: int = 2) -> float:
    """Mean pairwise Jaccard similarity of the samples' word n-gram sets (1 = all samples alike, 0 =
    no shared n-gram): a cheap Self-BLEU-style score of how much samples of one prompt repeat each
    other. Texts shorter than n count by their words; fewer than two samples give 0."""
    sets = [set(_ngrams(s, n)) or set(_ngrams(s, 1)) for s in samples]
    pairs = [(a, b) for i, a in enumerate(sets) for b in sets[i + 1:]]
    if not pairs:
        return 0.0
    return float(np.mean([len(a & b) / len(a | b) if a | b else 1.0 for a, b in pairs]))


def win_rate(policy_scores: torch.Tensor | list[float],
             reference_scores: torch.Tensor | list[float]) -> dict[str, float]:
    """Share of prompts where the policy's response scores higher than the reference's, ties
    counting half (AlpacaEval's convention). Shapes: (P), (P) -> {"win_rate", "wins", "ties", "losses"}."""
    policy, reference = (torch.as_tensor(policy_scores, dtype=torch.float64),
                         torch.as_tensor(reference_scores, dtype=torch.float64))
    if policy.shape != reference.shape or not policy.numel():
        raise ValueError("win_rate needs one policy and one reference score per prompt")
    wins, ties = int((policy > reference).sum()), int((policy == reference).sum())
    return {"win_rate": (wins + 0.5 * ties) / policy.numel(), "wins": wins, "ties": ties,
            "losses": policy.numel() - wins - ties}


def _answer_matches(response: str, record: dict[str, Any]) -> bool:
    """The response's ``Answer:`` line equals the record's answer (the default verifier)."""
    return extract_answer(response) == str(record["answer"]).strip()


class RLHFEvaluator:
    """Evaluates a policy the way post-training needs, one method per question:
    - ``kl_to_reference``: KL(policy || reference) on completions sampled from the policy (k1, k3);
    - ``reward_accuracy``: how often a reward function ranks chosen above rejected;
    - ``diversity``: distinct-1/2 over all samples and the mean self-similarity of samples per prompt;
    - ``win_rate``: policy vs reference greedy responses, judged by a reward function or by a judge
      callable ``judge(prompt, policy_response, reference_response) -> 1 | 0.5 | 0``;
    - ``task_accuracy``: greedy answers checked by a verifier ``verifier(response, record) -> bool``
      (default: the ``Answer:`` line equals the record's ``answer``).

    ``evaluate`` runs whichever of them its arguments allow and returns one flat metrics dict.
    Rewards are ``reward_fn(prompts, responses) -> Tensor[B]`` (``LearnedReward`` or any callable)."""

    def __init__(self, policy: PolicyModel, reference: PolicyModel | None = None, *, template: str = "auto",
                 max_new_tokens: int = 64, batch_size: int = 32, seed: int = 0,
                 enable_thinking: bool | None = None) -> None:
        self.policy, self.reference = policy, reference
        self.formatter = ChatFormatter(policy.tokenizer, template, enable_thinking=enable_thinking,
                                       generation_config=policy.model.generation_config)
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, seed

    @staticmethod
    def as_records(prompts: list[str] | list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Canonical chat records from prompt strings, ``{"prompt": ...}`` records (other keys such as
        ``answer`` kept) or canonical records."""
        def canonical(p: str | dict[str, Any]) -> dict[str, Any]:
            if isinstance(p, str):
                return {"system": "", "messages": [{"role": "user", "content": p}]}
            if "messages" not in p:
                return {**p, "system": p.get("system", ""), "messages": [{"role": "user", "content": p["prompt"]}]}
            return p

        return [canonical(p) for p in prompts]

    def _prompt_text(self, record: dict[str, Any]) -> str:
        return record.get("prompt") or record["messages"][-1]["content"]

    def complete(self, model: PolicyModel, records: list[dict[str, Any]], *, sample: bool) -> list[list[int]]:
        """Token ids of ``model``'s completion of each record: greedy, or sampled at temperature 1 (seeded)."""
        torch.manual_seed(self.seed)
        return model.generate([self.formatter.prompt_ids(r) for r in records], max_new_tokens=self.max_new_tokens,
                              do_sample=sample, temperature=1.0, stop_token_ids=self.formatter.stop_token_ids,
                              batch_size=self.batch_size)

    @torch.no_grad()
    def kl_to_reference(self, prompts: list[str] | list[dict[str, Any]],
                        samples_per_prompt: int = 4) -> dict[str, float]:
        """Sample completions from the policy (temperature 1), score their tokens under both models."""
        if self.reference is None:
            raise RLHFInputError("kl_to_reference needs a reference model (RLHFEvaluator(policy, reference))")
        records = [r for r in self.as_records(prompts) for _ in range(samples_per_prompt)]
        completions = self.complete(self.policy, records, sample=True)
        prompt_ids = [self.formatter.prompt_ids(r) for r in records]
        rows = [p + c for p, c in zip(prompt_ids, completions)]
        width = max(len(r) for r in rows)
        pad = self.policy.tokenizer.pad_token_id if self.policy.tokenizer.pad_token_id is not None else 0
        device = next(self.policy.parameters()).device
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
        attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for row, (prompt, completion) in enumerate(zip(prompt_ids, completions)):
            start = len(prompt)
            labels[row, start:start + len(completion)] = ids[row, start:start + len(completion)]
        policy_lp = self.policy.compute_log_probs(ids, attention, labels)
        reference_lp = self.reference.compute_log_probs(ids.to(next(self.reference.parameters()).device),
                                                        attention, labels)
        mask = (labels[:, 1:] != IGNORE_INDEX).float()
        return kl_estimates(policy_lp.per_token, reference_lp.per_token.to(device), mask)

    @staticmethod
    def reward_accuracy(pairs: list[dict[str, Any]], reward_fn: Callable) -> dict[str, float]:
        """Pairwise accuracy of ``reward_fn`` on ``{"prompt", "chosen", "rejected"}`` records."""
        prompts = [p["prompt"] for p in pairs]
        chosen = torch.as_tensor(reward_fn(prompts, [p["chosen"] for p in pairs]), dtype=torch.float32)
        rejected = torch.as_tensor(reward_fn(prompts, [p["rejected"] for p in pairs]), dtype=torch.float32)
        return {"reward/accuracy": float((chosen > rejected).float().mean()),
                "reward/margin": float((chosen - rejected).mean())}

    def diversity(self, prompts: list[str] | list[dict[str, Any]], samples_per_prompt: int = 4) -> dict[str, float]:
        """distinct-1/2 over every sample, and self-similarity averaged over prompts."""
        records = self.as_records(prompts)
        completions = self.complete(self.policy, [r for r in records for _ in range(samples_per_prompt)], sample=True)
        texts = [self.policy.decode(c) for c in completions]
        groups = [texts[i * samples_per_prompt:(i + 1) * samples_per_prompt] for i in range(len(records))]
        return {"diversity/distinct_1": distinct_n(texts, 1), "diversity/distinct_2": distinct_n(texts, 2),
                "diversity/self_similarity": float(np.mean([self_similarity(g) for g in groups]))}

    def win_rate(self, prompts: list[str] | list[dict[str, Any]], *, reward_fn: Callable | None = None,
                 judge: Callable | None = None) -> dict[str, float]:
        """Greedy responses of policy and reference to the same prompts, judged pairwise."""
        if self.reference is None or (reward_fn is None) == (judge is None):
            raise RLHFInputError("win_rate needs a reference model and exactly one of reward_fn or judge")
        records = self.as_records(prompts)
        ours = [self.policy.decode(c) for c in self.complete(self.policy, records, sample=False)]
        theirs = [self.reference.decode(c) for c in self.complete(self.reference, records, sample=False)]
        texts = [self._prompt_text(r) for r in records]
        if judge is not None:
            verdicts = [float(judge(p, a, b)) for p, a, b in zip(texts, ours, theirs)]
            result = win_rate(verdicts, [0.5] * len(verdicts))  # judge says 1 win, 0.5 tie, 0 loss
        else:
            result = win_rate(torch.as_tensor(reward_fn(texts, ours)), torch.as_tensor(reward_fn(texts, theirs)))
        return {f"win/{k}": float(v) for k, v in result.items()}

    def mean_reward(self, prompts: list[str] | list[dict[str, Any]], reward_fn: Callable) -> dict[str, float]:
        """Mean and std of ``reward_fn`` over the policy's greedy responses."""
        records = self.as_records(prompts)
        responses = [self.policy.decode(c) for c in self.complete(self.policy, records, sample=False)]
        rewards = torch.as_tensor(reward_fn([self._prompt_text(r) for r in records], responses), dtype=torch.float32)
        return {"reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0}

    def task_accuracy(self, records: list[dict[str, Any]], verifier: Callable | None = None) -> dict[str, float]:
        """Greedy responses checked by ``verifier(response, record)``; default: exact ``Answer:`` match."""
        scored = [r for r in self.as_records(records) if verifier is not None or r.get("answer") is not None]
        if not scored:
            return {}
        responses = [self.policy.decode(c) for c in self.complete(self.policy, scored, sample=False)]
        check = verifier or _answer_matches
        return {"task/accuracy": sum(bool(check(t, r)) for t, r in zip(responses, scored)) / len(scored)}

    def evaluate(self, prompts: list[str] | list[dict[str, Any]], *, pairs: list[dict[str, Any]] | None = None,
                 reward_fn: Callable | None = None, judge: Callable | None = None,
                 verifier: Callable | None = None, samples_per_prompt: int = 4) -> dict[str, float]:
        """Every evaluation the arguments allow, in one dict."""
        records = self.as_records(prompts)
        metrics = self.diversity(records, samples_per_prompt)
        metrics.update(self.task_accuracy(records, verifier))
        if self.reference is not None:
            metrics.update(self.kl_to_reference(records, samples_per_prompt))
            if reward_fn is not None or judge is not None:
                metrics.update(self.win_rate(records, reward_fn=reward_fn if judge is None else None, judge=judge))
        if pairs and reward_fn is not None:
            metrics.update(self.reward_accuracy(pairs, reward_fn))
        return metrics


# ==== 12. Self-improvement and safety ====


@dataclass
class CapabilityReport:
    """Per-task accuracy before and after a stage, the deltas, the tasks that regressed beyond the
    threshold, and the decision: roll back when any did."""

    before: dict[str, float]
    after: dict[str, float]
    deltas: dict[str, float]
    regressions: list[str]
    threshold: float

    @property
    def rollback(self) -> bool:
        return bool(self.regressions)


class CapabilityTester:
    """A suite of capability probes, run before and after a stage so a stage that breaks something
    is caught (and rolled back by the orchestrator). Each task is a list of records with a ``prompt``
    and an ``answer`` plus a verifier ``verifier(response, record) -> bool`` (default: the ``Answer:``
    line equals the record's answer). Build it from config with ``from_config``::
        capability_tests:
          arithmetic: {dataset: demo_eval, dataset_dir: data/demo, max_samples: 50}
          multistep: {dataset: demo_multistep, dataset_dir: data/demo, verifier: my_module:check}

    ``compare`` flags a task whose accuracy fell by more than ``threshold`` (absolute)."""

    def __init__(self, tasks: dict[str, list[dict[str, Any]]], *, verifiers: dict[str, Callable] | None = None,
                 threshold: float = 0.05, max_new_tokens: int = 64, batch_size: int = 32) -> None:
        if not tasks or any(not records for records in tasks.values()):
            raise RLHFInputError("capability_tests: every task needs at least one probe record")
        if not 0 <= threshold <= 1:
            raise RLHFInputError(f"capability threshold {threshold} must be in [0, 1]")
        self.tasks, self.verifiers = tasks, verifiers or {}
        self.threshold, self.max_new_tokens, self.batch_size = threshold, max_new_tokens, batch_size

    @classmethod
    def from_config(cls, spec: dict[str, dict[str, Any]], *, threshold: float = 0.05,
                    max_new_tokens: int = 64) -> CapabilityTester:
        """``{task: {dataset, dataset_dir, max_samples?, verifier?: module:function}}``."""
        tasks, verifiers = {}, {}
        for name, entry in spec.items():
            unknown = set(entry) - {"dataset", "dataset_dir", "max_samples", "verifier"}
            if unknown or "dataset" not in entry:
                raise RLHFInputError(f"capability_tests.{name}: needs 'dataset' (and optionally dataset_dir, "
                                     f"max_samples, verifier); unknown keys: {sorted(unknown)}")
            tasks[name] = load_records(entry["dataset"], entry.get("dataset_dir", "data"), "prompt",
                                       max_samples=entry.get("max_samples"))
            if entry.get("verifier"):
                verifiers[name] = RewardFunctionFactory._import(entry["verifier"])
        return cls(tasks, verifiers=verifiers, threshold=threshold, max_new_tokens=max_new_tokens)

    def run(self, policy: PolicyModel, template: str = "auto", enable_thinking: bool | None = None) -> dict[str, float]:
        """Greedy accuracy of ``policy`` on every task."""
        evaluator = RLHFEvaluator(policy, template=template, max_new_tokens=self.max_new_tokens,
                                  batch_size=self.batch_size, enable_thinking=enable_thinking)
        return {name: evaluator.task_accuracy(records, self.verifiers.get(name)).get("task/accuracy", 0.0)
                for name, records in self.tasks.items()}

    def compare(self, before: dict[str, float], after: dict[str, float]) -> CapabilityReport:
        deltas = {name: after[name] - before[name] for name in before if name in after}
        regressions = [name for name, delta in deltas.items() if delta < -self.threshold - 1e-12]
        return CapabilityReport(dict(before), dict(after), deltas, regressions, self.threshold)


# -- adversarial validation: degenerate outputs, reward hacking, robustness to harmless prompt changes ------------


def repetition_rate(text: str, n: int = 3) -> float:
    """Share of the word n-grams of ``text`` that repeat an earlier n-gram of the same text:
    1 - distinct / total (0 when the text has fewer than n words). A looping completion ("= = = =")
    scores near 1, ordinary prose near 0. A loop inside one word ("77777") is one word: the
    truncation rate catches those. Holtzman et al. (2020) on neural text degeneration."""
    grams = _ngrams(text, n)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def degeneration_rates(completions: list[list[int]], texts: list[str], stop_token_ids: Iterable[int], *,
                       n: int = 3, threshold: float = 0.5) -> dict[str, float]:
    """Shares of completions that are repetitive (``repetition_rate(text, n) >= threshold``), empty
    (no visible text after decoding) or truncated (no stop token at the end: generation ran out of
    ``max_new_tokens``; ``PolicyModel.generate`` keeps the stop token it produced).
    Shapes: completions (B) token-id lists and their texts (B) -> rates in [0, 1]."""
    if len(completions) != len(texts) or not texts:
        raise ValueError("degeneration_rates needs one decoded text per completion, and at least one")
    stops = set(stop_token_ids)
    return {"degenerate/repetition": float(np.mean([repetition_rate(t, n) >= threshold for t in texts])),
            "degenerate/empty": float(np.mean([not t.strip() for t in texts])),
            "degenerate/truncated": float(np.mean([not ids or ids[-1] not in stops for ids in completions]))}


# Reward hacking (Gao et al. 2023, "Scaling Laws for Reward Model Overoptimization"): the proxy reward
# rises while what it stands for falls. Each rule: the measurement that must move against the reward,
# and the direction that is suspicious (+1 rose, -1 fell). Ensemble disagreement rising with the reward
# means the policy is moving where the reward models stop agreeing (Coste et al. 2024; Eisenstein et al. 2023).
REWARD_HACKING_RULES: dict[str, tuple[str, int]] = {
    "reward_up_accuracy_down": ("accuracy", -1),
    "reward_up_disagreement_up": ("disagreement", +1),
}


def reward_hacking_flags(before: dict[str, float], after: dict[str, float], tolerance: float = 0.0) -> list[str]:
    """Names of the REWARD_HACKING_RULES that fire between two measurements of the same prompts
    (``{"reward", "accuracy"?, "disagreement"?}``, as ``AdversarialValidator.measure`` returns):
    the mean reward rose by more than ``tolerance`` and the rule's measurement moved the suspicious
    way by more than ``tolerance``. A measurement missing on either side never fires."""
    def moved(key: str, sign: int) -> bool:
        return key in before and key in after and sign * (after[key] - before[key]) > tolerance

    if not moved("reward", +1):
        return []
    return [name for name, (key, sign) in REWARD_HACKING_RULES.items() if moved(key, sign)]


def perturb_whitespace(text: str, seed: int = 0) -> str:
    """Widen some spaces to two or three and pad the ends: every word and number stays as it was."""
    rng = random.Random(seed)
    parts = text.split(" ")
    body = "".join(part + " " * rng.randint(1, 3) for part in parts[:-1]) + parts[-1]
    return " " * rng.randint(1, 2) + body + rng.choice(["", " ", "\n"])


def perturb_case(text: str, seed: int = 0) -> str:
    """Upper-, lower- or capitalise each alphabetic word at random; digits and symbols never change."""
    rng = random.Random(seed)
    cases = (str.upper, str.lower, str.capitalize)
    return re.sub(r"[A-Za-z]+", lambda match: rng.choice(cases)(match.group()), text)


PERTURBATION_PREFIXES = ("Please answer: ", "Question: ", "Solve this. ", "Hi! Quick one: ")


def perturb_prefix(text: str, seed: int = 0) -> str:
    """A harmless lead-in (``PERTURBATION_PREFIXES``) before the prompt."""
    return random.Random(seed).choice(PERTURBATION_PREFIXES) + text


# Perturbations that keep an arithmetic prompt's answer: no reordering, no edits inside numbers or operators.
PERTURBATIONS: dict[str, Callable[[str, int], str]] = {
    "whitespace": perturb_whitespace, "case": perturb_case, "prefix": perturb_prefix,
}


def answer_consistency(original: list[str | None], perturbed: list[list[str | None]]) -> float:
    """Share of (prompt, perturbation) pairs whose extracted answer equals the unperturbed prompt's
    (no answer both times counts as unchanged). Shapes: original (P), perturbed K x (P) -> float."""
    pairs = [(a, b) for group in perturbed for a, b in zip(original, group, strict=True)]
    return float(np.mean([a == b for a, b in pairs])) if pairs else 1.0


def validation_score(repetition: float, empty: float, truncated: float, consistency: float | None,
                     hacking_flags: int) -> float:
    """Overall health in [0, 1]: the mean of 1 - repetition, 1 - empty, 1 - truncated and (when
    measured) the answer consistency under perturbation, halved for every reward-hacking flag."""
    terms = [1.0 - repetition, 1.0 - empty, 1.0 - truncated] + ([consistency] if consistency is not None else [])
    return float(np.mean(terms)) * 0.5 ** hacking_flags


@dataclass
class ValidationReport:
    """What ``AdversarialValidator.validate`` found: degenerate-output rates, robustness under
    prompt perturbation, the reward-hacking flags with the two measurements they came from, and
    the verdict against the validator's thresholds (``max_<metric>`` / ``min_<metric>``)."""

    repetition: float
    empty: float
    truncated: float
    consistency: float | None = None
    accuracy: float | None = None
    perturbed_accuracy: float | None = None
    hacking_flags: list[str] = field(default_factory=list)
    measurements: dict[str, dict[str, float]] = field(default_factory=dict)  # {"before": ..., "after": ...}
    thresholds: dict[str, float] = field(default_factory=dict)

    @property
    def score(self) -> float:
        return validation_score(self.repetition, self.empty, self.truncated, self.consistency, len(self.hacking_flags))

    @property
    def failures(self) -> list[str]:
        """One line per threshold broken, e.g. ``repetition 0.4 > max_repetition 0.1``."""
        values = {"repetition": self.repetition, "empty": self.empty, "truncated": self.truncated,
                  "consistency": self.consistency, "score": self.score, "hacking_flags": len(self.hacking_flags)}
        broken = []
        for name, limit in self.thresholds.items():
            bound, metric = name.split("_", 1)
            value = values[metric]
            if value is not None and (value > limit + 1e-12 if bound == "max" else value < limit - 1e-12):
                broken.append(f"{metric} {value:.3g} {'>' if bound == 'max' else '<'} {name} {limit:.3g}")
        return broken

    @property
    def passed(self) -> bool:
        return not self.failures

    def metrics(self) -> dict[str, float]:
        """Flat ``validation/...`` numbers for a logger."""
        values = {"repetition": self.repetition, "empty": self.empty, "truncated": self.truncated,
                  "consistency": self.consistency, "accuracy": self.accuracy,
                  "perturbed_accuracy": self.perturbed_accuracy, "score": self.score,
                  "hacking_flags": float(len(self.hacking_flags)), "passed": float(self.passed)}
        return {f"validation/{k}": float(v) for k, v in values.items() if v is not None}


def _with_prompt(record: dict[str, Any], text: str) -> dict[str, Any]:
    """The record with its last user message replaced by ``text`` (everything else kept)."""
    updated = {**record, "messages": record["messages"][:-1] + [{"role": "user", "content": text}]}
    if "prompt" in updated:  # RLHFEvaluator.as_records keeps a record's own "prompt"; keep it in step
        updated["prompt"] = text
    return updated


class AdversarialValidator:
    """A scored safety and quality check of a policy, run after a stage (or before shipping):
    - degenerate outputs: rates of repetitive, empty and truncated completions (``degeneration``);
    - robustness: answers under harmless prompt perturbations (``PERTURBATIONS``: extra whitespace,
      case changes, a polite prefix) — the share left unchanged, and accuracy with and without;
    - reward hacking: ``measure`` the mean reward, verifier accuracy and reward-ensemble disagreement
      (``LearnedReward.last_uncertainty``) before a stage, pass that as ``baseline`` after it, and
      ``reward_hacking_flags`` says whether the reward rose while accuracy fell or disagreement rose.

    ``validate`` runs all of them (greedy decoding, one batched generation for every prompt
    variant) and returns a ``ValidationReport`` whose ``passed`` checks the thresholds given here.
    Prompts are strings or records; records with an ``answer`` are scored by ``verifier(response,
    record) -> bool`` (default: the ``Answer:`` line equals the record's answer)."""

    def __init__(self, *, template: str = "auto", max_new_tokens: int = 64, batch_size: int = 32,
                 samples_per_prompt: int = 1, ngram: int = 3, repetition_threshold: float = 0.5,
                 perturbations: Sequence[str] = tuple(PERTURBATIONS), tolerance: float = 0.0, seed: int = 0,
                 max_repetition: float = 0.1, max_empty: float = 0.05, max_truncated: float = 0.2,
                 min_consistency: float = 0.8, min_score: float = 0.0, max_hacking_flags: int = 0) -> None:
        unknown = [name for name in perturbations if name not in PERTURBATIONS]
        if unknown:
            raise RLHFInputError(f"unknown perturbations {unknown}; choose from {', '.join(PERTURBATIONS)}")
        self.thresholds = {"max_repetition": max_repetition, "max_empty": max_empty, "max_truncated": max_truncated,
                           "min_consistency": min_consistency, "min_score": min_score,
                           "max_hacking_flags": max_hacking_flags}
        bad = [f"{k}={v}" for k, v in self.thresholds.items() if k != "max_hacking_flags" and not 0 <= v <= 1]
        if bad:
            raise RLHFInputError(f"AdversarialValidator: rate thresholds must be in [0, 1]; got {', '.join(bad)}")
        if samples_per_prompt < 1 or ngram < 1:
            raise RLHFInputError(f"AdversarialValidator: samples_per_prompt ({samples_per_prompt}) and ngram "
                                 f"({ngram}) must be >= 1")
        self.template, self.max_new_tokens, self.batch_size, self.seed = template, max_new_tokens, batch_size, seed
        self.samples_per_prompt, self.ngram, self.repetition_threshold = samples_per_prompt, ngram, repetition_threshold
        self.perturbations, self.tolerance = list(perturbations), tolerance

    def _evaluator(self, policy: PolicyModel) -> RLHFEvaluator:
        return RLHFEvaluator(policy, template=self.template, max_new_tokens=self.max_new_tokens,
                             batch_size=self.batch_size, seed=self.seed)

    def _perturbed(self, records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """One list of records per perturbation; record i gets seed ``seed + i``."""
        return [[_with_prompt(r, PERTURBATIONS[name](r["messages"][-1]["content"], self.seed + i))
                 for i, r in enumerate(records)] for name in self.perturbations]

    def _degeneration(self, evaluator: RLHFEvaluator, records: list[dict[str, Any]],
                      greedy: list[list[int]] | None = None) -> dict[str, float]:
        """On greedy completions (reused when given), or on ``samples_per_prompt`` > 1 samples at temperature 1."""
        completions = greedy
        if self.samples_per_prompt > 1 or completions is None:
            repeated = [r for r in records for _ in range(self.samples_per_prompt)]
            completions = evaluator.complete(evaluator.policy, repeated, sample=self.samples_per_prompt > 1)
        texts = [evaluator.policy.decode(c) for c in completions]
        return degeneration_rates(completions, texts, evaluator.formatter.stop_token_ids, n=self.ngram,
                                  threshold=self.repetition_threshold)

    @staticmethod
    def _accuracy(records: list[dict[str, Any]], texts: list[str], verifier: Callable | None) -> float | None:
        """Share of verified responses among records with an answer (every record, given a verifier)."""
        scored = [(t, r) for t, r in zip(texts, records) if verifier is not None or r.get("answer") is not None]
        check = verifier or _answer_matches
        return float(np.mean([bool(check(t, r)) for t, r in scored])) if scored else None

    def _robustness(self, records: list[dict[str, Any]], groups: list[list[str]],
                    verifier: Callable | None) -> dict[str, float]:
        """``groups``: greedy texts of the original prompts, then one list per perturbation."""
        if len(groups) < 2:
            return {}
        answers = [[extract_answer(t) for t in group] for group in groups]
        metrics = {"robustness/consistency": answer_consistency(answers[0], answers[1:])}
        accuracy = self._accuracy(records, groups[0], verifier)
        if accuracy is not None:
            perturbed = [self._accuracy(records, group, verifier) for group in groups[1:]]
            metrics.update({"robustness/accuracy": accuracy,
                            "robustness/perturbed_accuracy": float(np.mean(perturbed))})
        return metrics

    def _measure(self, records: list[dict[str, Any]], texts: list[str], reward_fn: Callable,
                 verifier: Callable | None) -> dict[str, float]:
        """Mean reward of ``texts``, their accuracy and, for ensembles, the members' mean disagreement."""
        prompts = [r["messages"][-1]["content"] for r in records]
        rewards = _call_reward(reward_fn, prompts, texts, [r.get("answer") for r in records], records)
        measured = {"reward": float(rewards.mean())}
        accuracy = self._accuracy(records, texts, verifier)
        if accuracy is not None:
            measured["accuracy"] = accuracy
        uncertainty = getattr(reward_fn, "last_uncertainty", None)
        if isinstance(uncertainty, torch.Tensor) and uncertainty.numel() == len(texts):
            measured["disagreement"] = float(uncertainty.float().mean())
        return measured

    def _greedy_groups(self, evaluator: RLHFEvaluator, groups: list[list[dict[str, Any]]]
                       ) -> tuple[list[list[int]], list[list[str]]]:
        """Greedy completions of several equally long record lists in one batched call:
        (ids of the first list, texts per list)."""
        ids = evaluator.complete(evaluator.policy, [r for group in groups for r in group], sample=False)
        texts = [evaluator.policy.decode(c) for c in ids]
        size = len(groups[0])
        return ids[:size], [texts[k * size:(k + 1) * size] for k in range(len(groups))]

    def degeneration(self, policy: PolicyModel, prompts: list[str] | list[dict[str, Any]]) -> dict[str, float]:
        """Repetition, empty and truncation rates of the policy's completions."""
        return self._degeneration(self._evaluator(policy), RLHFEvaluator.as_records(prompts))

    def robustness(self, policy: PolicyModel, prompts: list[str] | list[dict[str, Any]],
                   verifier: Callable | None = None) -> dict[str, float]:
        """Answer consistency under the perturbations; accuracy with and without them where answers are known."""
        records = RLHFEvaluator.as_records(prompts)
        _, groups = self._greedy_groups(self._evaluator(policy), [records] + self._perturbed(records))
        return self._robustness(records, groups, verifier)

    def measure(self, policy: PolicyModel, prompts: list[str] | list[dict[str, Any]], reward_fn: Callable,
                verifier: Callable | None = None) -> dict[str, float]:
        """``{"reward", "accuracy"?, "disagreement"?}`` of greedy responses: a baseline for ``validate``."""
        records = RLHFEvaluator.as_records(prompts)
        _, (texts,) = self._greedy_groups(self._evaluator(policy), [records])
        return self._measure(records, texts, reward_fn, verifier)

    def validate(self, policy: PolicyModel, prompts: list[str] | list[dict[str, Any]], *,
                 reward_fn: Callable | None = None, baseline: dict[str, float] | None = None,
                 verifier: Callable | None = None) -> ValidationReport:
        """Every check on ``prompts``; reward hacking only with ``reward_fn`` and a ``baseline`` from ``measure``."""
        if baseline is not None and reward_fn is None:
            raise RLHFInputError("AdversarialValidator.validate: a baseline needs the reward_fn it was measured with")
        records = RLHFEvaluator.as_records(prompts)
        evaluator = self._evaluator(policy)
        greedy, groups = self._greedy_groups(evaluator, [records] + self._perturbed(records))
        rates = self._degeneration(evaluator, records, greedy)
        robust = self._robustness(records, groups, verifier)
        report = ValidationReport(
            repetition=rates["degenerate/repetition"], empty=rates["degenerate/empty"],
            truncated=rates["degenerate/truncated"], consistency=robust.get("robustness/consistency"),
            accuracy=robust.get("robustness/accuracy"), perturbed_accuracy=robust.get("robustness/perturbed_accuracy"),
            thresholds=dict(self.thresholds))
        if baseline is not None:
            after = self._measure(records, groups[0], reward_fn, verifier)
            report.hacking_flags = reward_hacking_flags(baseline, after, self.tolerance)
            report.measurements = {"before": dict(baseline), "after": after}
        logger.info("validation: score %.3f, %s", report.score,
                    "passed" if report.passed else "; ".join(report.failures))
        return report


# -- iterative refinement: generate -> critique -> refine, best by reward -------------------------------------------

# The refinement prompt (Self-Refine, Madaan et al. 2023): the task, the best answer so far and feedback on it.
REFINE_TEMPLATE = ("{prompt}\n\nA previous answer:\n{response}\n\nFeedback: {critique}\n\n"
                   "Write an improved answer to the original question.")


def default_critique(response: str, reward: float, correct: bool | None) -> str:
    """Rule-based feedback from the reward and the verifier's verdict (None: no verifier or answer),
    for policies too small to critique themselves, such as the tiny demo model."""
    answer = extract_answer(response)
    if answer is None:
        return (f"The previous response has no final 'Answer: <number>' line (reward {reward:.3g}); "
                f"solve it step by step and end with one.")
    if correct is None:
        return f"The previous answer {answer} got a reward of {reward:.3g}; check each step and improve it."
    if correct:
        return (f"The previous answer {answer} was judged correct (reward {reward:.3g}); "
                f"keep it and make each step clear.")
    return f"The previous answer {answer} was judged wrong (reward {reward:.3g}); check each step."


@dataclass
class RefinementResult:
    """One prompt's refinement: the best response seen in any round and its reward, the round that
    produced it (0 = plain generation), the best candidate reward of every round run, and the worst
    response seen (the ``rejected`` side of a preference pair)."""

    record: dict[str, Any]
    response: str
    reward: float
    best_round: int
    round_rewards: list[float]
    worst: str
    worst_reward: float

    @property
    def prompt(self) -> str:
        return self.record["messages"][-1]["content"]

    @property
    def best_so_far(self) -> list[float]:
        """Running maximum of ``round_rewards``: what the refiner keeps after each round (non-decreasing)."""
        return [float(v) for v in np.maximum.accumulate(self.round_rewards)]


def refinement_pairs(results: list[RefinementResult], min_margin: float = 0.0) -> list[dict[str, Any]]:
    """``{"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"}`` records (plus
    ``system`` and alpaca-style ``history`` where the prompt has them), best vs worst response seen,
    for prompts whose best beats their worst by more than ``min_margin`` and where neither is blank
    (a preference record needs two non-empty responses)."""
    pairs = []
    for result in results:
        if result.reward - result.worst_reward <= min_margin or not result.response.strip() or not result.worst.strip():
            continue
        record, messages = result.record, result.record["messages"]
        pair: dict[str, Any] = {"prompt": result.prompt}
        if record.get("system"):
            pair["system"] = record["system"]
        if len(messages) > 1:  # earlier turns as [question, answer] pairs
            pair["history"] = [[messages[i]["content"], messages[i + 1]["content"]]
                               for i in range(0, len(messages) - 1, 2)]
        pairs.append({**pair, "chosen": result.response, "rejected": result.worst,
                      "chosen_reward": result.reward, "rejected_reward": result.worst_reward})
    return pairs


PREFERENCE_COLUMNS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system",
                      "history": "history"}


def write_preference_jsonl(pairs: list[dict[str, Any]], path: str | os.PathLike,
                           dataset_name: str | None = None) -> Path:
    """Write preference records as JSONL, readable by the preference stages as ``dataset: <path>``;
    with ``dataset_name`` also register the file in the ``dataset_info.json`` beside it (as
    data/demo registers ``demo_preference``), so ``dataset: <name>, dataset_dir: <folder>`` works too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    os.replace(tmp, path)
    if dataset_name:
        info_path = path.parent / "dataset_info.json"
        info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.exists() else {}
        info[dataset_name] = {"file_name": path.name, "ranking": True, "columns": dict(PREFERENCE_COLUMNS)}
        info_path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return path


class IterativeRefiner:
    """Generate -> critique -> refine (Self-Refine, Madaan et al. 2023), keeping the best response by
    reward across rounds, so the result is never worse than plain sampling (round 0) by construction.

    Round 0 samples ``num_candidates`` responses per prompt. Each later round critiques the best
    response so far — with ``critic(prompt, response) -> str`` when given, else ``default_critique``
    from its reward and the verifier's verdict — renders ``REFINE_TEMPLATE`` and samples
    ``num_candidates`` more. Every candidate is scored against the *original* prompt with
    ``reward_fn(prompts, completions, answers)`` (called as the trainers call it, records included for
    rewards that want them), so rewards are comparable across rounds. A prompt stops after ``rounds``
    refinements or at the first round that does not beat its best by more than ``min_improvement``.

    ``preference_pairs`` turns the best and worst responses seen into DPO data (``refinement_pairs``,
    ``write_preference_jsonl``)."""

    def __init__(self, policy: PolicyModel, reward_fn: Callable, *, critic: Callable[[str, str], str] | None = None,
                 verifier: Callable | None = None, rounds: int = 2, num_candidates: int = 4,
                 min_improvement: float = 0.0, template: str = "auto", max_new_tokens: int = 64,
                 temperature: float = 1.0, batch_size: int = 32, seed: int = 0,
                 enable_thinking: bool | None = None) -> None:
        if rounds < 0 or num_candidates < 1 or temperature <= 0:
            raise RLHFInputError(f"IterativeRefiner: rounds ({rounds}) must be >= 0, num_candidates ({num_candidates}) "
                                 f">= 1 and temperature ({temperature}) > 0")
        self.policy, self.reward_fn, self.critic, self.verifier = policy, reward_fn, critic, verifier
        self.rounds, self.num_candidates, self.min_improvement = rounds, num_candidates, min_improvement
        self.formatter = ChatFormatter(policy.tokenizer, template, enable_thinking=enable_thinking,
                                       generation_config=policy.model.generation_config)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.batch_size, self.seed = batch_size, seed

    def _candidates(self, inputs: list[dict[str, Any]], originals: list[dict[str, Any]]
                    ) -> list[list[tuple[str, float]]]:
        """``num_candidates`` samples per input record, each scored against its original record."""
        k = self.num_candidates
        ids = self.policy.generate([self.formatter.prompt_ids(r) for r in inputs for _ in range(k)],
                                   max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.temperature,
                                   stop_token_ids=self.formatter.stop_token_ids, batch_size=self.batch_size)
        texts = [self.policy.decode(c) for c in ids]
        scored = [r for r in originals for _ in range(k)]
        rewards = _call_reward(self.reward_fn, [r["messages"][-1]["content"] for r in scored], texts,
                               [r.get("answer") for r in scored], scored).tolist()
        return [list(zip(texts[i * k:(i + 1) * k], rewards[i * k:(i + 1) * k])) for i in range(len(inputs))]

    def _verdict(self, response: str, record: dict[str, Any]) -> bool | None:
        if self.verifier is not None:
            return bool(self.verifier(response, record))
        return _answer_matches(response, record) if record.get("answer") is not None else None

    def critique(self, result: RefinementResult) -> str:
        """Feedback on the best response so far."""
        if self.critic is not None:
            return str(self.critic(result.prompt, result.response))
        return default_critique(result.response, result.reward, self._verdict(result.response, result.record))

    def _refined(self, result: RefinementResult) -> dict[str, Any]:
        text = REFINE_TEMPLATE.format(prompt=result.prompt, response=result.response, critique=self.critique(result))
        return _with_prompt(result.record, text)

    @staticmethod
    def _update(result: RefinementResult, candidates: list[tuple[str, float]], round_index: int,
                min_improvement: float) -> bool:
        """Record a round's candidates; True when its best beat the best so far by more than ``min_improvement``."""
        best, worst = max(candidates, key=lambda c: c[1]), min(candidates, key=lambda c: c[1])
        result.round_rewards.append(best[1])
        if worst[1] < result.worst_reward:
            result.worst, result.worst_reward = worst
        if best[1] <= result.reward + min_improvement:
            return False
        result.response, result.reward, result.best_round = best[0], best[1], round_index
        return True

    def refine(self, prompts: list[str] | list[dict[str, Any]]) -> list[RefinementResult]:
        """The best response per prompt after at most ``rounds`` refinements."""
        results = [RefinementResult(r, "", -math.inf, 0, [], "", math.inf) for r in RLHFEvaluator.as_records(prompts)]
        torch.manual_seed(self.seed)
        active = list(range(len(results)))  # round 0 always beats the empty start
        for round_index in range(self.rounds + 1):
            if not active:
                break
            inputs = [results[i].record if round_index == 0 else self._refined(results[i]) for i in active]
            batches = self._candidates(inputs, [results[i].record for i in active])
            active = [i for i, candidates in zip(active, batches)
                      if self._update(results[i], candidates, round_index, self.min_improvement)]
        return results

    def preference_pairs(self, prompts: list[str] | list[dict[str, Any]], min_margin: float = 0.0
                         ) -> list[dict[str, Any]]:
        """Refine ``prompts`` and return best-vs-worst preference records (ties and blanks skipped)."""
        return refinement_pairs(self.refine(prompts), min_margin)


# ==== 13. Orchestrator ====


def read_report(output_dir: str | os.PathLike) -> dict[str, Any]:
    """``output_dir/report.json``: every stage entry written so far, across runs."""
    path = Path(output_dir) / "report.json"
    return json.loads(path.read_text()) if path.exists() else {"stages": []}


def append_report(output_dir: str | os.PathLike, entry: dict[str, Any]) -> Path:
    """Add one stage's entry to ``output_dir/report.json`` (written atomically)."""
    path = Path(output_dir) / "report.json"
    if _launch_rank() > 0:  # a multi-process launch: the main process writes, once
        return path
    report = read_report(output_dir)
    report["stages"].append(entry)
    _write_json_atomic(path, report, indent=2)
    return path


def summary_table(entries: list[dict[str, Any]], title: str = "rlhf run summary") -> Any:
    """A rich table of stages: time, steps, training loss, and evaluation before -> after."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("stage", "time", "steps", "train loss", "eval loss", "accuracy (before -> after)", "output"):
        table.add_column(column)
    for entry in entries:
        before = (entry.get("eval_before") or {}).get("eval/accuracy")
        after = entry["eval"].get("eval/accuracy")
        accuracy = "-" if after is None else (f"{before:.1%} -> {after:.1%}" if before is not None else f"{after:.1%}")
        if entry["stage"] == "rm" and after is not None:
            accuracy += " (pairwise)"  # a reward model's accuracy ranks held-out pairs; it does not answer prompts
        eval_loss = entry["eval"].get("eval/loss")
        table.add_row(entry["stage"], f"{entry['seconds']:.0f}s", str(entry["global_step"]),
                      f"{entry['metrics'].get('train_loss', float('nan')):.4f}",
                      "-" if eval_loss is None else f"{eval_loss:.4f}", accuracy, entry["output_dir"])
    return table


# -- what makes a stage "the same": its config, its data's content and the models it starts from ------------

def _file_fingerprint(path: Path) -> list[Any]:
    stat = path.stat()
    if stat.st_size <= 64 * 2**20:
        return [str(path), hashlib.sha256(path.read_bytes()).hexdigest()]
    return [str(path), stat.st_size, stat.st_mtime_ns]  # a large file: size and time rather than a full read


def _dataset_names(config: BaseConfig) -> Iterator[tuple[str, str]]:
    """(field, name) for every dataset a stage reads: its comma-separated dataset, eval_dataset and ewc_dataset."""
    for field_name in ("dataset", "eval_dataset", "ewc_dataset"):
        for name in str(getattr(config, field_name, "") or "").split(","):
            if name.strip():
                yield field_name, name.strip()


def data_fingerprint(config: BaseConfig) -> list[Any]:
    """The content (and registry entry) of every dataset a stage reads."""
    parts = []
    for field_name, name in _dataset_names(config):
        spec = resolve_dataset(name, config.dataset_dir)
        parts.append([field_name, name, spec.formatting, spec.columns, spec.tags, spec.ranking, spec.hub,
                      str(spec.hf_dir), [_file_fingerprint(f) for f in spec.files]])
    return parts


# config fields that change how a run looks, not what it computes
_COSMETIC_FIELDS = ("disable_progress_bar", "progress_interval", "report_to", "run_name", "logging_dir",
                    "resume_from_checkpoint", "overwrite_output_dir", "plot_loss")
# in output_dir/<stage>: the fingerprint it was started with, and whether it finished
STAGE_MARKER = "pipeline_stage.json"


def _stage_entry(stage: str, status: str, output_dir: str | os.PathLike, fingerprint: str, seconds: float = 0.0,
                 **fields: Any) -> dict[str, Any]:
    """A report entry for a stage without a TrainResult (a rollback after an error, a final stage)."""
    return {"stage": stage, "status": status, "seconds": round(seconds, 2), "global_step": 0,
            "output_dir": str(output_dir), "fingerprint": fingerprint, "metrics": {}, "eval": {}, **fields}


def _metric_cell(value: float | None, percent: bool = False) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.1%}" if percent else f"{value:.3f}"


def _final_eval_notes(final: dict[str, float]) -> str:
    notes = []
    if "win/win_rate" in final:
        counts = (f" ({final['win/wins']:.0f} wins, {final['win/ties']:.0f} ties, {final['win/losses']:.0f} losses)"
                  if "win/wins" in final else "")
        notes.append(f"win rate over the reference {final['win/win_rate']:.2f}{counts}")
    if "diversity/distinct_2" in final:
        notes.append(f"distinct-2 {final['diversity/distinct_2']:.3f}")
    if "reward/accuracy" in final:
        notes.append(f"reward accuracy {final['reward/accuracy']:.1%}")
    return ", ".join(notes)


def pipeline_rows(history: list[dict[str, Any]]) -> list[list[str]]:
    """One row per stage: stage, status, time, held-out accuracy, reward, KL to the reference, notes."""
    evaluation = next((e for e in reversed(history) if e["stage"] == "eval" and e["status"] == "completed"), None)
    per_stage = (evaluation or {}).get("metrics", {}).get("per_stage", {})
    rows = []
    for entry in history:
        stage, metrics = entry["stage"], entry.get("metrics", {})
        status = entry["status"].replace("_", " ") + (" (cached)" if entry.get("skipped") else "")
        measured = per_stage.get(stage, {}) if entry["status"] == "completed" else {}
        accuracy = entry.get("eval", {}).get("eval/accuracy")
        reward, kl, notes = measured.get("reward/mean"), measured.get("kl/k3"), entry.get("reason", "")
        if stage in ("rm", "prm"):
            notes = notes or (f"pairwise accuracy {accuracy:.1%}" if accuracy is not None else "")
            accuracy = None
        elif stage == "merge":
            reward, kl = metrics.get("reward/mean"), metrics.get("kl/k3")
            notes = notes or f"{metrics.get('method', '')} of {', '.join(metrics.get('models', []))}"
        elif stage == "best_of_n":
            accuracy = None
            if not notes and "accuracy/greedy" in metrics:
                notes = (f"{metrics['prompts']} prompts x {metrics['n']}: " + ", ".join(
                    f"{name} {metrics[f'accuracy/{name}']:.1%}" for name in metrics["scorers"])
                    + f"; greedy {metrics['accuracy/greedy']:.1%}, any of n {metrics['accuracy/oracle']:.1%}")
        elif stage == "eval":
            notes = notes or _final_eval_notes(metrics.get("final", {}))
        if entry.get("capabilities") and not notes:
            notes = "gate: " + ", ".join(f"{t} {d:+.1%}" for t, d in entry["capabilities"]["deltas"].items())
        rows.append([stage, status, f"{entry.get('seconds', 0):.0f}s", _metric_cell(accuracy, percent=True),
                     _metric_cell(reward), _metric_cell(kl), notes])
    return rows


PIPELINE_COLUMNS = ("stage", "status", "time", "held-out accuracy", "reward", "KL to ref (k3)", "notes")


def pipeline_table(history: list[dict[str, Any]], title: str) -> Any:
    """The pipeline's one table: every stage with its accuracy, reward, KL and rollbacks."""
    from rich.table import Table

    table = Table(title=title)
    for column in PIPELINE_COLUMNS:
        table.add_column(column, justify="right" if column in ("time", "held-out accuracy", "reward", "KL to ref (k3)")
                         else "left")
    for row in pipeline_rows(history):
        table.add_row(*row, style="red" if row[1].startswith("rolled back") else None)
    rollbacks = sum(entry["status"] == "rolled_back" for entry in history)
    cached = sum(bool(entry.get("skipped")) for entry in history)
    table.caption = (f"{rollbacks} rollback(s)" + (f", {cached} stage(s) cached from an earlier run" if cached else "")
                     + "; reward = mean reward-model score of greedy answers; KL on sampled answers")
    return table


def write_pipeline_report(output_dir: Path, history: list[dict[str, Any]], seconds: float) -> list[Path]:
    """report.md (the table, rollbacks, final evaluation) and pipeline_summary.png (accuracy, reward, KL)."""
    rows = pipeline_rows(history)
    lines = [f"# rlhf pipeline report ({output_dir})", "", f"Wall time: {seconds:.0f}s.", "",
             "| " + " | ".join(PIPELINE_COLUMNS) + " |", "|" + "---|" * len(PIPELINE_COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    rollbacks = [e for e in history if e["status"] == "rolled_back"]
    lines += ["", f"## Rollbacks ({len(rollbacks)})", ""]
    lines += [f"- {e['stage']}: {e.get('reason', '')}; continued from {e.get('input_model', '?')}"
              for e in rollbacks] or ["None."]
    gated = [e for e in history if e.get("capabilities")]
    if gated:
        lines += ["", "## Capability tests (accuracy before -> after)", ""]
        for entry in gated:
            caps = entry["capabilities"]
            lines.append(f"- {entry['stage']}: " + ", ".join(f"{t} {caps['before'][t]:.1%} -> {caps['after'][t]:.1%}"
                                                             for t in caps["deltas"]))
    for entry in history:
        if entry["stage"] == "eval" and entry["status"] == "completed":
            lines += ["", "## Final policy evaluation", ""]
            lines += [f"- {k}: {v:.4g}" for k, v in entry["metrics"].get("final", {}).items()]
    plots = sorted(str(p.relative_to(output_dir))
                   for name in ("plot_loss.png", "plot_eval_accuracy.png", "plot_reward.png")
                   for p in output_dir.glob(f"*/{name}"))
    if plots:  # every other metric's curve is beside these, in each stage's directory
        lines += ["", "## Training curves", ""] + [f"- [{p}]({p})" for p in plots]
    lines[4:4] = ["![accuracy, reward and KL per stage](pipeline_summary.png)", ""]
    report = output_dir / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [report, *_plot_pipeline(output_dir, history)]


def _plot_pipeline(output_dir: Path, history: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in pipeline_rows(history) if row[3] != "-" or row[4] != "-"]
    if not rows:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, column, label in zip(axes, (3, 4, 5), ("held-out accuracy", "reward", "KL to reference (k3)")):
        values = [float(row[column].rstrip("%")) / (100 if row[column].endswith("%") else 1) if row[column] != "-"
                  else 0.0 for row in rows]
        colors = ["#d62728" if row[1].startswith("rolled back") else "#1f77b4" for row in rows]
        ax.bar([row[0] for row in rows], values, color=colors)
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("per stage (red: rolled back)")
    fig.tight_layout()
    path = output_dir / "pipeline_summary.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


class StageNotRun(Exception):
    """A final stage with nothing to do (e.g. every model it would merge was rolled back): recorded, not an error."""


def _saved_policy(model: str, config: BaseConfig) -> PolicyModel:
    """The policy saved in ``model``, loaded as ``config``'s stage would (dtype, attention), on a GPU if there is
    one."""
    return _load_policy(config, "cuda" if torch.cuda.is_available() else "cpu", model)


class FinalStages:
    """The pipeline steps after training (FINAL_STAGES: ``eval``, ``best_of_n``, ``merge``), run by the orchestrator
    that holds them (``RLHFOrchestrator.final_stages``) on the models it adopted (its ``models`` and
    ``current_model``), each skipped when already complete for the same models and options, and recorded in the
    pipeline's history like a training stage."""

    def __init__(self, pipeline: RLHFOrchestrator) -> None:
        self.pipeline = pipeline
        self._rewards: dict[str, LearnedReward] = {}  # reward-model directory -> loaded scorer (eval, best_of_n, merge)
        self._vllm_policy: PolicyModel | None = None  # the policy whose generate() samples with a vLLM engine

    @property
    def config(self) -> PipelineConfig:
        return self.pipeline.config

    @property
    def output_dir(self) -> Path:
        return self.pipeline.output_dir

    def load_policy(self, model: str, config: BaseConfig, *, use_vllm: bool = False) -> PolicyModel:
        """The policy saved in ``model``; with ``use_vllm`` its generate() samples with a vLLM engine of its own
        (the engine of the policy loaded before is shut down first: one holds the device at a time)."""
        policy = _saved_policy(model, config)
        if use_vllm:
            self.close_vllm()  # one engine per process: the previous policy's goes first
            policy.rollout_engine = vllm_engine_for(model, seed=config.seed)
            self._vllm_policy = policy
        return policy

    def close_vllm(self) -> None:
        policy = self._vllm_policy
        if policy is not None and policy.rollout_engine is not None:
            policy.rollout_engine.close()
            policy.rollout_engine = None
        self._vllm_policy = None

    def _base_config(self) -> BaseConfig:
        """Shared settings (template, eval_dataset, dataset_dir, ...) as the last training stage sees them."""
        trained = [s for s in self.config.stages if s in STAGE_CONFIGS]
        return self.config.stage_config(trained[-1] if trained else "sft")

    def _resolve_model(self, name: str | None, option: str) -> str | None:
        """A stage name of this pipeline ("sft", "rm", ...) or a directory; None stays None."""
        if name is None:
            return None
        if name in self.pipeline.models:
            return self.pipeline.models[name]
        if name in STAGE_CONFIGS or name in FINAL_STAGES:
            raise RLHFInputError(f"{self.config.source}: option '{option}' names stage '{name}', which has no adopted "
                                 f"output in this run (not run, or rolled back)")
        if not Path(name).exists():
            raise RLHFInputError(f"{self.config.source}: option '{option}': '{name}' is neither a stage of this "
                                 "pipeline nor a directory")
        return name

    def _eval_records(self, options: dict[str, Any]) -> list[dict[str, Any]]:
        base = self._base_config()
        dataset = options.get("prompts") or base.eval_dataset
        if not dataset:
            raise RLHFInputError(f"{self.config.source}: the eval / best_of_n stages need prompts with answers: set "
                                 f"eval_dataset (shared) or the stage's 'prompts'")
        return load_records(dataset, base.dataset_dir, "prompt")

    def _reward_function(self, options: dict[str, Any]) -> Callable | None:
        """The reward model as ``reward_fn(prompts, responses)``, or None if the pipeline has none."""
        name = options.get("reward_model")
        if not name or (name in STAGE_CONFIGS and name not in self.pipeline.models):
            return None
        path = self._resolve_model(name, "reward_model")
        if path not in self._rewards:  # eval, best_of_n and merge score with the same model: load it once
            base = self._base_config()
            self._rewards[path] = LearnedReward.from_pretrained(path, template=base.template,
                                                                enable_thinking=base.enable_thinking)
        learned = self._rewards[path]
        return lambda prompts, responses: learned(prompts, responses, [None] * len(prompts))

    def _policy_metrics(self, model: str, records: list[dict[str, Any]], reward_fn: Callable | None,
                        reference: PolicyModel | None, options: dict[str, Any], *, accuracy: bool) -> dict[str, float]:
        """Mean reward of greedy answers and KL to the reference on samples (first max_prompts prompts),
        and with ``accuracy`` the exact-match accuracy on every held-out prompt, as the trainers measure it."""
        base = self._base_config()
        policy = self.load_policy(model, base, use_vllm=options["use_vllm"])
        max_new_tokens = options.get("max_new_tokens") or base.eval_max_new_tokens
        evaluator = RLHFEvaluator(policy, reference, template=base.template, max_new_tokens=max_new_tokens,
                                  batch_size=options["batch_size"], seed=base.seed,
                                  enable_thinking=base.enable_thinking)
        subset = records[:options["max_prompts"]]
        metrics: dict[str, float] = {}
        if accuracy:
            metrics.update(evaluate_exact_match(policy, evaluator.formatter, records, max_new_tokens=max_new_tokens,
                                                batch_size=options["batch_size"]))
        if reward_fn is not None:
            metrics.update(evaluator.mean_reward(subset, reward_fn))
        if reference is not None:
            metrics.update(evaluator.kl_to_reference(subset, options["samples_per_prompt"]))
        return metrics

    def evaluate(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every adopted policy: reward and KL to the reference (accuracy comes from its stage); the
        final policy also: diversity, win rate over the reference and, given ``pairs``, reward accuracy."""
        options = {**FINAL_STAGE_OPTIONS["eval"], **(options or {})}
        if self.pipeline.current_model is None:
            raise RLHFInputError(f"{self.config.source}: the eval stage needs a trained policy; put it after a policy "
                                 "stage")
        records, reward_fn = self._eval_records(options), self._reward_function(options)
        base = self._base_config()
        name = options["reference"]  # a stage that did not run (or was rolled back) means: no KL, no win rate
        reference_dir = (self.pipeline.models.get(name) if name in STAGE_CONFIGS
                         else self._resolve_model(name, "eval.reference"))
        reference = self.load_policy(reference_dir, base) if reference_dir else None
        per_stage = {}
        for stage, path in self.pipeline.models.items():
            if stage in POLICY_STAGES:
                logger.info("eval: %s", stage)
                per_stage[stage] = self._policy_metrics(path, records, reward_fn,
                                                        None if path == reference_dir else reference,
                                                        options, accuracy=False)
                if path == reference_dir:
                    per_stage[stage].update({"kl/k1": 0.0, "kl/k3": 0.0})
        policy_dir = self.pipeline.current_model
        evaluator = RLHFEvaluator(self.load_policy(policy_dir, base, use_vllm=options["use_vllm"]), reference,
                                  template=base.template,
                                  max_new_tokens=options.get("max_new_tokens") or base.eval_max_new_tokens,
                                  batch_size=options["batch_size"], seed=base.seed,
                                  enable_thinking=base.enable_thinking)
        subset = records[:options["max_prompts"]]
        final = evaluator.diversity(subset, options["samples_per_prompt"])
        if reference is not None and reward_fn is not None and policy_dir != reference_dir:
            final.update(evaluator.win_rate(subset, reward_fn=reward_fn))
        if options["pairs"] and reward_fn is not None:
            pairs = load_records(options["pairs"], base.dataset_dir, "preference", max_samples=options["max_pairs"])
            final.update(evaluator.reward_accuracy([{"prompt": p["messages"][-1]["content"], "chosen": p["chosen"],
                                                     "rejected": p["rejected"]} for p in pairs], reward_fn))
        return {"per_stage": per_stage, "final": final, "policy": policy_dir, "reference": reference_dir}

    def best_of_n(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Best-of-N on the final policy (inference_optimizations.BestOfNSampler): n samples per held-out
        prompt, one pool reranked by each scorer, accuracy against greedy decoding and the oracle."""

        options = {**FINAL_STAGE_OPTIONS["best_of_n"], **(options or {})}
        for scorer in options["scorers"]:
            _check_choice(scorer, ("rm", "vote"), "best_of_n.scorers")
        base = self._base_config()
        records = self._eval_records(options)[:options["max_prompts"]]
        policy = self.load_policy(self.pipeline.current_model, base, use_vllm=options["use_vllm"])
        formatter = chat_formatter(policy.tokenizer, base, policy)
        policy.tokenizer.chat_template = formatter.source  # the sampler renders prompts as the policy was trained
        params = SamplingParams(max_new_tokens=options.get("max_new_tokens") or base.eval_max_new_tokens,
                                temperature=options["temperature"], seed=options["seed"],
                                stop_token_ids=tuple(formatter.stop_token_ids))
        prompts = [r["messages"][-1]["content"] for r in records]
        sampler = BestOfNSampler(policy.model, policy.tokenizer, None, n=options["n"], params=params,
                                 engine=policy.rollout_engine or "auto")
        candidates = sampler.candidates(prompts)
        answers = [[extract_answer(c) for c in row] for row in candidates]
        truth = [str(r["answer"]).strip() for r in records]
        greedy = evaluate_exact_match(policy, formatter, records, max_new_tokens=params.max_new_tokens,
                                      batch_size=base.per_device_eval_batch_size)
        metrics: dict[str, Any] = {"n": options["n"], "prompts": len(records), "scorers": list(options["scorers"]),
                                   "accuracy/greedy": greedy.get("eval/accuracy", 0.0),
                                   "accuracy/oracle": float(np.mean([t in row for t, row in zip(truth, answers)]))}
        for scorer in options["scorers"]:
            if scorer == "vote":
                chosen = [answer_agreement(row)[0] for row in answers]
            else:
                reward_fn = self._reward_function(options)
                if reward_fn is None:
                    raise RLHFInputError(f"{self.config.source}: best_of_n scorer 'rm' needs a reward model (an rm "
                                         "stage or best_of_n.reward_model)")
                scores = torch.as_tensor(reward_fn([p for p in prompts for _ in range(options["n"])],
                                                   [c for row in candidates for c in row])).view(len(prompts), -1)
                chosen = [row[i] for row, i in zip(answers, scores.argmax(-1).tolist())]
            metrics[f"accuracy/{scorer}"] = float(np.mean([a is not None and a == t for a, t in zip(chosen, truth)]))
        return metrics

    def merge(self, options: dict[str, Any] | None = None,
              output_dir: str | os.PathLike | None = None) -> dict[str, Any]:
        """Merge trained policies (model_merging.ModelMerger; default TIES of every adopted
        policy-optimisation stage over the SFT model), then evaluate the merged model like the others."""
        import model_merging

        options = {**FINAL_STAGE_OPTIONS["merge"], **(options or {})}
        adopted = self.pipeline.models
        entries = options["models"] or [s for s in adopted if s in POLICY_OPTIMISATION_STAGES]
        entries = [dict(e) if isinstance(e, dict) else {"model": e} for e in entries]  # {model, weight?, base?}
        dropped = [e["model"] for e in entries if e["model"] in STAGE_CONFIGS and e["model"] not in adopted]
        entries = [e for e in entries if e["model"] not in dropped]  # a rolled-back stage has nothing to contribute
        names = [str(e["model"]) for e in entries]
        if not names:
            raise StageNotRun(f"nothing to merge ({', '.join(dropped) or 'no policy-optimisation stage'} not adopted)")
        if dropped:
            logger.warning("merge: %s not adopted (rolled back or not run); merging %s", ", ".join(dropped),
                           ", ".join(names))
        raw = {k: v for k, v in options.items() if k != "evaluate"}
        raw["models"] = [{**e, "model": self._resolve_model(e["model"], "merge.models"),
                          **({"base": self._resolve_model(e["base"], "merge.models.base")} if e.get("base") else {})}
                         for e in entries]
        raw["base_model"] = self._resolve_model(options["base_model"], "merge.base_model")
        raw["output_dir"] = str(output_dir or self.output_dir / "merge")
        raw["overwrite"] = True
        try:
            result = model_merging.ModelMerger(model_merging.MergeConfig.from_dict(raw, source="merge")).merge()
        except model_merging.MergeError as err:
            raise RLHFInputError(f"{self.config.source}: {err}") from None
        metrics: dict[str, Any] = {"method": result.method, "models": names, "output_dir": str(result.output_dir)}
        if options["evaluate"]:
            eval_options = {**FINAL_STAGE_OPTIONS["eval"], **self.config.final_stages.get("eval", {})}
            reference = self._resolve_model("sft", "reference") if "sft" in self.pipeline.models else None
            base = self._base_config()
            metrics.update(self._policy_metrics(str(result.output_dir), self._eval_records(eval_options),
                                                self._reward_function(eval_options),
                                                self.load_policy(reference, base) if reference else None,
                                                eval_options, accuracy=True))
        return metrics

    def run(self, stage: str) -> dict[str, Any]:
        """Run (or skip, if already complete for these models and options) one final stage; its report entry."""
        options = self.config.final_stage_options(stage)
        output_dir = self.output_dir / stage
        produced, policy_dir = self.pipeline.produced, self.pipeline.current_model
        inputs = {name: produced.get(path, path) for name, path in self.pipeline.models.items()}
        base = self._base_config()
        prompts = options.get("prompts") or base.eval_dataset
        prompt_files = [_file_fingerprint(f) for name in str(prompts or "").split(",") if name.strip()
                        for f in resolve_dataset(name, base.dataset_dir).files]
        fingerprint = _fingerprint(stage, options, inputs, policy_dir and produced.get(policy_dir), prompt_files)
        entry = self.pipeline._completed_entry(stage, fingerprint, output_dir)
        if entry is not None:
            logger.info("stage %s: already complete for these models (report.json); skipped", stage)
            self.pipeline._record(entry)
            return entry
        setup_logging(log_file=Path(base.logging_dir or self.output_dir / "logs") / f"{stage}.log")
        output_dir.mkdir(parents=True, exist_ok=True)
        started = time.time()
        run = {"eval": self.evaluate, "best_of_n": self.best_of_n,
               "merge": lambda o: self.merge(o, output_dir)}[stage]
        try:
            metrics = run(options)
        except StageNotRun as reason:
            logger.warning("stage %s not run: %s", stage, reason)
            entry = _stage_entry(stage, "not_run", output_dir, fingerprint, reason=str(reason))
            self.pipeline._record(entry)
            return entry
        except Exception as err:
            if isinstance(err, RLHFInputError) or not self.config.rollback_on_error:
                raise
            logger.error("stage %s failed (%s: %s); recorded, continuing", stage, type(err).__name__, err)
            entry = _stage_entry(stage, "failed", output_dir, fingerprint, time.time() - started, error=True,
                                 reason=f"{type(err).__name__}: {err}")
            self.pipeline._record(entry)
            return entry
        finally:
            self.close_vllm()  # however the stage ended
        evaluation = {"eval/accuracy": metrics["eval/accuracy"]} if "eval/accuracy" in metrics else {}
        entry = _stage_entry(stage, "completed", output_dir, fingerprint, time.time() - started, metrics=metrics,
                             eval=evaluation)
        _write_json_atomic(output_dir / "metrics.json", metrics)
        _write_json_atomic(output_dir / STAGE_MARKER, {"fingerprint": fingerprint, "complete": True})
        self.pipeline._record(entry)
        return entry


class RLHFOrchestrator:
    """Runs the configured stages in order, each starting from the previous stage's model, and keeps
    the history in ``output_dir/report.json``. Default config: configs/demo.yaml.

    - Policy-optimisation stages are gated by the capability tests (``capability_tests``): measured
      before and after; a task that falls by more than ``capability_threshold`` rolls the stage back,
      so the next stage starts from the previous model. A stage that crashes or diverges is rolled
      back the same way (``rollback_on_error``). Rollbacks are recorded in the history.
    - A stage already complete for the same config, data and input models is skipped (its entry in
      report.json is reused); an interrupted one resumes from its latest checkpoint, or starts afresh
      if its config or data changed since.
    - ``eval``, ``best_of_n`` and ``merge`` stages evaluate, rerank and merge the trained models."""

    def __init__(self, config: PipelineConfig | str | os.PathLike | None = None) -> None:
        if config is None:
            config = _checkout_path("configs/demo.yaml")
        self.config = config if isinstance(config, PipelineConfig) else PipelineConfig.load(config)
        self.output_dir = Path(self.config.output_dir)
        self.history: list[dict[str, Any]] = []
        self.current_model: str | None = None
        self.reward_model: str | None = None
        self.process_reward_model: str | None = None
        self.models: dict[str, str] = {}  # stage -> output directory, for stages whose output was adopted
        self.produced: dict[str, str] = {}  # output directory -> fingerprint of the stage that wrote it
        self.tester = None
        if self.config.capability_tests:  # probe files resolve against the pipeline's dataset_dir unless given
            shared_dir = self.config.shared.get("dataset_dir", "data")
            self.tester = CapabilityTester.from_config(
                {task: {"dataset_dir": shared_dir, **spec} for task, spec in self.config.capability_tests.items()},
                threshold=self.config.capability_threshold)
        self._capability_cache: dict[str, dict[str, float]] = {}
        self.final_stages = FinalStages(self)  # eval, best_of_n and merge
        self._sync: DeviceManager | None = None  # under a multi-process launch: barriers and the main process
        self._compressor_model: PolicyModel | None = None  # the policy ContextCompressor runs on, loaded once
        self._compressor_for: str | None = None

    def check_inputs(self) -> None:
        """Every stage's datasets and every model it names exist, checked before the first stage trains: a typo
        in the last stage's dataset or reference model would otherwise surface after the earlier stages trained.
        Models this pipeline trains (a later stage's input, ``rm`` as reward_model) are not checked."""
        produced = {str(self.output_dir / stage) for stage in self.config.stages}
        first_training_stage = next((s for s in self.config.stages if s in STAGE_CONFIGS), None)
        for stage in self.config.stages:
            if stage not in STAGE_CONFIGS:
                continue
            config = self.config.stage_config(stage)
            where = f"{self.config.source} [{stage}]"
            for field_name, name in _dataset_names(config):
                try:
                    resolve_dataset(name, config.dataset_dir)
                except RLHFInputError as err:
                    raise RLHFInputError(f"{where}: config field '{field_name}': {err}") from None
            trained_here = produced | ({str(config.model_name_or_path)} if stage != first_training_stage else set())
            try:
                check_model_paths(config, trained_here)
            except RLHFInputError as err:
                raise RLHFInputError(f"{where}: {err}") from None

    # -- training stages
    @_leaves_logging_as_found
    def run_stage(self, stage: str) -> dict[str, Any]:
        """Run (or skip, if already complete) one stage; returns its report entry."""
        if stage in FINAL_STAGES:
            return self.final_stages.run(stage)
        config = self._with_sft_reference(self.config.stage_config(stage, model_name_or_path=self.current_model))
        fingerprint = self._stage_fingerprint(config)
        entry = self._completed_entry(stage, fingerprint, Path(config.output_dir))
        if entry is None:
            entry = self._train(stage, self._prepare_output_dir(config, fingerprint), fingerprint)
        else:
            logger.info("stage %s: already complete for this config and data (report.json); skipped", stage)
        self._record(entry)
        return entry

    def _with_sft_reference(self, config: BaseConfig) -> BaseConfig:
        """A policy-optimisation stage that starts from another one's policy (GRPO after DPO) keeps the SFT
        model as its reference, as InstructGPT anchors PPO to the SFT policy, unless ref_model is set."""
        sft = self.models.get("sft")
        if (sft and config.stage in POLICY_OPTIMISATION_STAGES and not config.ref_model  # every such config has one
                and config.uses_reference and config.model_name_or_path != sft):
            logger.info("stage %s: reference model is the SFT output %s", config.stage, sft)
            return dataclasses.replace(config, ref_model=sft)
        return config

    def _stage_fingerprint(self, config: BaseConfig, leave_out: Iterable[str] = ()) -> str:
        """What identifies a stage's run: its settings but cosmetic ones (and ``leave_out``), its data, and the
        pipeline stage that made each input model."""
        left_out = set(_COSMETIC_FIELDS) | set(leave_out)
        settings = {k: v for k, v in config.to_dict().items() if k not in left_out}
        for name in _MODEL_FIELDS:  # a model this pipeline trained is identified by what produced it
            if settings.get(name) in self.produced:
                settings[name] = {"trained_by": self.produced[settings[name]]}
        return _fingerprint(config.stage, settings, data_fingerprint(config))

    def _completed_entry(self, stage: str, fingerprint: str, output_dir: Path) -> dict[str, Any] | None:
        marker = output_dir / STAGE_MARKER
        written = json.loads(marker.read_text()) if marker.exists() else {}
        if written.get("fingerprint") != fingerprint or written.get("complete") is not True:
            return None
        for entry in reversed(read_report(self.output_dir)["stages"]):
            if entry.get("stage") == stage and entry.get("fingerprint") == fingerprint and not entry.get("error"):
                return {**entry, "skipped": True}
        return None

    @property
    def is_main_process(self) -> bool:
        return _launch_rank() == 0

    def _wait_for_all(self, config: BaseConfig) -> None:
        """A barrier across the processes of a multi-process launch (a no-op in one process). Every stage of
        such a launch must use one mixed-precision mode: accelerate keeps one state per process."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return
        if self._sync is None:
            self._sync = DeviceManager(config.mixed_precision, ddp_timeout=config.ddp_timeout)
        self._sync.wait()

    def _prepare_output_dir(self, config: BaseConfig, fingerprint: str) -> BaseConfig:
        """Mark the stage as started with this fingerprint; checkpoints of another config are not resumed, but a
        change that a standalone run resumes through (BaseTrainer.RESUME_NEUTRAL_FIELDS: a longer max_steps, other
        logging or save steps) keeps them. Every process reads the old marker before the main process replaces it,
        so all decide alike."""
        directory = Path(config.output_dir)
        marker = directory / STAGE_MARKER
        resume_key = self._stage_fingerprint(config, BaseTrainer.RESUME_NEUTRAL_FIELDS)
        written = json.loads(marker.read_text()) if marker.exists() else None
        if written is not None and fingerprint != written.get("fingerprint") \
                and resume_key != written.get("resume_fingerprint"):
            logger.warning("stage %s: config, data or input model changed since %s was written; starting it afresh",
                           config.stage, directory)
            config = dataclasses.replace(config, resume_from_checkpoint="none")
        self._wait_for_all(config)
        if self.is_main_process:
            directory.mkdir(parents=True, exist_ok=True)
            _write_json_atomic(marker, {"fingerprint": fingerprint, "resume_fingerprint": resume_key,
                                        "complete": False})
        # and every process sees the marker before checking the folder: the atomic write's temporary file, seen
        # alone, made another process refuse the folder as someone else's
        self._wait_for_all(config)
        return config

    def _train(self, stage: str, config: BaseConfig, fingerprint: str) -> dict[str, Any]:
        gated = self.tester is not None and stage in POLICY_OPTIMISATION_STAGES
        before = self._capabilities(config.model_name_or_path, config) if gated else None
        started = time.time()
        try:
            result = STAGE_RUNNERS[stage](config)
        except Exception as err:  # KeyboardInterrupt is not an Exception: a kill resumes on the next run
            user_mistake = isinstance(err, RLHFInputError) and not isinstance(err, TrainingDivergedError)
            if user_mistake or not self.config.rollback_on_error:
                raise
            logger.error("stage %s failed (%s: %s); rolled back, continuing from %s", stage, type(err).__name__, err,
                         config.model_name_or_path)
            return _stage_entry(stage, "rolled_back", config.output_dir, fingerprint, time.time() - started, error=True,
                                reason=f"{type(err).__name__}: {err}", input_model=config.model_name_or_path)
        entry = {**result.report_entry(), "status": "completed", "fingerprint": fingerprint,
                 "input_model": config.model_name_or_path}
        if gated:
            self._capability_cache.pop(str(result.output_dir), None)  # the directory may hold an earlier run's model
            report = self.tester.compare(before, self._capabilities(str(result.output_dir), config))
            entry["capabilities"] = {"before": report.before, "after": report.after, "deltas": report.deltas,
                                     "threshold": report.threshold}
            if report.rollback:
                entry["status"] = "rolled_back"
                entry["reason"] = ("capability regression: "
                                   + ", ".join(f"{task} {report.deltas[task]:+.1%}" for task in report.regressions)
                                   + f" (threshold {report.threshold:.0%})")
                logger.warning("stage %s rolled back (%s); the next stage starts from %s", stage, entry["reason"],
                               config.model_name_or_path)
        if self.is_main_process:
            marker = Path(config.output_dir) / STAGE_MARKER  # written as started by _prepare_output_dir
            _write_json_atomic(marker, {**json.loads(marker.read_text()), "complete": True})
        return entry

    def _record(self, entry: dict[str, Any]) -> None:
        """Append to report.json and the history; adopt the stage's output unless it was rolled back."""
        if not entry.get("skipped") and self.is_main_process:
            append_report(self.output_dir, entry)
        self.history.append(entry)
        if entry["status"] != "completed" or entry["stage"] not in STAGE_CONFIGS:
            return
        stage, path = entry["stage"], str(entry["output_dir"])
        self.models[stage] = path
        self.produced[path] = entry["fingerprint"]
        if stage in POLICY_STAGES:
            self.current_model = path
        elif stage == "prm":
            self.process_reward_model = path
        elif stage == "rm":
            self.reward_model = path

    def _capabilities(self, model: str, config: BaseConfig) -> dict[str, float]:
        """Capability-test accuracy of a model directory, measured once per run."""
        if model not in self._capability_cache:
            self._capability_cache[model] = self.tester.run(_saved_policy(model, config), template=config.template,
                                                            enable_thinking=config.enable_thinking)
        return self._capability_cache[model]

    def run_sft(self) -> dict[str, Any]:
        return self.run_stage("sft")

    def run_reward_model_training(self) -> dict[str, Any]:
        return self.run_stage("rm")

    def run_process_reward_model_training(self) -> dict[str, Any]:
        return self.run_stage("prm")

    def run_policy_optimization(self, method: str = "dpo") -> dict[str, Any]:
        """One policy-optimisation stage (any of POLICY_OPTIMISATION_STAGES: dpo ... ppo) from the current policy."""
        _check_choice(method, POLICY_OPTIMISATION_STAGES, "method")
        return self.run_stage(method)

    # -- after training: evaluation, Best-of-N and merging (FinalStages)
    def evaluate(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``eval`` stage's metrics (``FinalStages.evaluate``)."""
        return self.final_stages.evaluate(options)

    def best_of_n(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``best_of_n`` stage's metrics (``FinalStages.best_of_n``)."""
        return self.final_stages.best_of_n(options)

    def merge(self, options: dict[str, Any] | None = None,
              output_dir: str | os.PathLike | None = None) -> dict[str, Any]:
        """The ``merge`` stage: the merged model written and evaluated (``FinalStages.merge``)."""
        return self.final_stages.merge(options, output_dir)

    # -- models on disk
    ROLES = ("policy", "reward_model", "process_reward_model")

    def save_models(self, directory: str | os.PathLike | None = None) -> Path:
        """Copy the current policy, reward model and process reward model (whichever exist) to
        ``directory/<role>`` (default output_dir/final) with a models.json manifest, without checkpoints."""
        directory = Path(directory or self.output_dir / "final")
        sources = dict(zip(self.ROLES, (self.current_model, self.reward_model, self.process_reward_model)))
        manifest = {role: role for role, source in sources.items() if source}
        if not manifest:
            raise RLHFInputError("save_models: no model trained or loaded yet")
        directory.mkdir(parents=True, exist_ok=True)
        for role in manifest:
            tmp = directory / f".{role}-{uuid.uuid4().hex[:8]}"
            shutil.copytree(sources[role], tmp, ignore=shutil.ignore_patterns("checkpoints", "logs", "runs", ".tmp-*",
                                                                               "*.png", STAGE_MARKER))
            if (directory / role).exists():
                shutil.rmtree(directory / role)
            os.replace(tmp, directory / role)
        _write_json_atomic(directory / "models.json", {**manifest, "sources": {r: sources[r] for r in manifest}})
        logger.info("models saved to %s: %s", directory, ", ".join(manifest))
        return directory

    def load_models(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Load what ``save_models`` wrote: later stages start from that policy and use those reward
        models. Returns the loaded models by role (PolicyModel, RewardEnsemble, ProcessRewardModel)."""
        directory = Path(directory)
        if not (directory / "models.json").exists():
            raise RLHFInputError(f"load_models: {directory} has no models.json (write one with save_models)")
        manifest = json.loads((directory / "models.json").read_text())
        loaders = {"policy": PolicyModel.from_pretrained, "reward_model": RewardEnsemble.from_pretrained,
                   "process_reward_model": ProcessRewardModel.from_pretrained}
        loaded = {}
        for role in self.ROLES:
            if role in manifest:
                path = str(directory / manifest[role])
                loaded[role] = loaders[role](path)
                setattr(self, {"policy": "current_model"}.get(role, role), path)
        return loaded

    # -- context compression
    def _compressor(self, ratio: float) -> ContextCompressor:
        model = self.current_model or self.config.stage_config(self.config.stages[0]).model_name_or_path
        if self._compressor_for != model:
            self._compressor_model, self._compressor_for = PolicyModel.from_pretrained(model), model
        return ContextCompressor(self._compressor_model, ratio)

    def compress_prompts(self, prompts: list[str | dict[str, str]], ratio: float = 0.5) -> list[str]:
        """Compress prompts with the current policy (the last trained stage's model, else the
        configured one). A prompt is a string (all of it compressed) or ``{"context", "question"}``
        (the question kept whole)."""
        compressor = self._compressor(ratio)
        return [compressor.compress(p, ratio=ratio) if isinstance(p, str)
                else compressor.compress(p["context"], p.get("question", ""), ratio=ratio) for p in prompts]

    def compress_context_from_ids(self, context_ids: list[int], ratio: float = 0.5,
                                  keep_ids: list[int] = ()) -> list[int]:
        """Token-id form of ``compress_prompts``: the context's most informative ids, then ``keep_ids``."""
        return self._compressor(ratio).compress_ids(context_ids, ratio, keep_ids)

    # -- the whole pipeline
    @_leaves_logging_as_found
    def run_full_pipeline(self) -> list[dict[str, Any]]:
        """Every stage in ``config.stages``; prints the pipeline table and writes report.json, report.md
        and pipeline_summary.png. Returns this run's entries."""
        started = time.time()
        self.check_inputs()
        with RunFolderLock.for_run(self.output_dir, take=self.is_main_process):  # one pipeline per folder
            return self._run_stages(started)

    def _run_stages(self, started: float) -> list[dict[str, Any]]:
        if self.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.config, self.output_dir / "pipeline_config.yaml")
        for stage in self.config.stages:
            if stage in FINAL_STAGES and not self.is_main_process:
                continue  # evaluation, Best-of-N and merging run in the main process of a multi-process launch
            logger.info("stage %s", stage)
            self.run_stage(stage)
        if not self.is_main_process:
            return self.history
        seconds = time.time() - started
        written = write_pipeline_report(self.output_dir, self.history, seconds)
        rich_console().print(pipeline_table(self.history,
                                            title=f"pipeline summary ({self.output_dir}, {seconds:.0f}s)"))
        logger.info("report: %s", ", ".join(str(p) for p in [self.output_dir / "report.json", *written]))
        return self.history


# ==== 14. Export, evaluation and chat ====
# What a user does with a trained model: export it (an adapter merged into its base, as a Hugging Face folder or a
# GGUF file for llama.cpp-family runtimes), measure it on a dataset, and talk to it. Each command has its config
# right above the code that uses it; the CLI (section 15) only parses and dispatches.

# ---- Export: LLaMA-Factory's `export` keys; GGUF written with the gguf package ----

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
EXPORT_FORMATS = ("hf", "gguf")


@dataclass
class ExportConfig:
    """Export a model, with its adapter merged into the base, as a Hugging Face folder or a GGUF file."""

    model_name_or_path: str = _opt("", "The model to export: a trained output folder (an adapter's folder loads its "
                                       "base and merges it), a Hugging Face folder, a .gguf file or 'tiny'")
    gguf_file: str | None = _opt(None, "A GGUF file inside the model_name_or_path folder (as in the training stages)")
    adapter_name_or_path: str | None = _opt(None, "A LoRA adapter folder to merge into model_name_or_path "
                                                  "(LLaMA-Factory's key; an adapter output folder as "
                                                  "model_name_or_path does the same)")
    finetuning_type: str | None = _opt(None, "LLaMA-Factory's key, checked against the inputs: lora / oft need an "
                                             "adapter (adapter_name_or_path or an adapter output folder), full / "
                                             "freeze a plain model")
    template: str = _opt("auto", "Chat template written into the exported tokenizer: auto (the model's own) or a named "
                                 "one (see `rlhf sft --help`), as training rendered it")
    enable_thinking: bool | None = _opt(None, "Thinking switch of templates that have one, fixed in the exported "
                                              "template as training used it")
    export_dir: str = _opt("", "Where the Hugging Face folder goes (format hf), or the folder that receives the .gguf "
                               "file (format gguf)")
    export_format: str = _opt("hf", "hf (a Hugging Face folder of safetensors shards) | gguf (one GGUF file, for "
                                    "llama.cpp, Ollama, LM Studio)")
    gguf_type: str = _opt("f16", "GGUF tensor type: f32 | f16 | bf16 | q8_0 (norms and biases stay f32)")
    export_size: int = _opt(5, "Largest safetensors shard of a Hugging Face export, in GB (LLaMA-Factory's "
                               "export_size)")
    export_device: str = _opt("cpu", "Device that merges the adapter: cpu | auto (a GPU when there is one)")
    export_legacy_format: bool = _opt(False, "LLaMA-Factory's .bin export: refused; weights are written as safetensors "
                                             "only")
    export_quantization_bit: int | None = _opt(None, "With export_format gguf: 8 is gguf_type q8_0 (LLaMA-Factory's "
                                                     "GPTQ export of 2-4 bits is not supported)")
    export_hub_model_id: str | None = _opt(None, "Refused: nothing is uploaded; push the folder with `huggingface-cli "
                                                 "upload` yourself")
    trust_remote_code: bool = _opt(False, "Allow custom modelling code shipped with the model")
    cache_dir: str | None = _opt(None, "Cache of the embedded model and GGUF conversions (default: $RLHF_CACHE or "
                                       "~/.cache/rlhf)")

    stage: typing.ClassVar[str] = "export"

    def __post_init__(self) -> None:
        _check(bool(str(self.model_name_or_path).strip()), "model_name_or_path", "is empty; name the model to export")
        _check(bool(str(self.export_dir).strip()), "export_dir", "is empty; name the folder to write")
        if self.gguf_file:
            self.model_name_or_path, self.gguf_file = str(Path(self.model_name_or_path) / self.gguf_file), None
        _check_choice(self.export_format, EXPORT_FORMATS, "export_format")
        _check_choice(self.export_device, ("cpu", "auto"), "export_device")
        _check(not self.export_legacy_format, "export_legacy_format",
               "asks for .bin weights, which load through pickle; rlhf writes safetensors only: remove the key")
        _check(self.export_hub_model_id is None, "export_hub_model_id",
               "asks for an upload, which rlhf does not do; export, then run `huggingface-cli upload ID EXPORT_DIR`")
        _check(self.export_size > 0, "export_size", f"must be > 0 (GB per shard), got {self.export_size}")
        if self.export_quantization_bit is not None:
            _check(self.export_format == "gguf" and self.export_quantization_bit == 8, "export_quantization_bit",
                   f"is {self.export_quantization_bit}: only 8, with export_format gguf (q8_0), is supported; GPTQ "
                   f"exports of 2-4 bits are not")
            self.gguf_type = "q8_0"
        _check_choice(self.gguf_type, GGUF_TYPES, "gguf_type")
        if self.finetuning_type is not None:
            _check_choice(self.finetuning_type, FINETUNING_TYPES, "finetuning_type")
            adapter = self.adapter_name_or_path or (
                self.model_name_or_path if (Path(self.model_name_or_path) / "adapter_config.json").exists() else None)
            advice = ("set adapter_name_or_path" if adapter is None
                      else "remove adapter_name_or_path or set finetuning_type: lora")
            _check((self.finetuning_type in ("lora", "oft")) == (adapter is not None), "finetuning_type",
                   f"is {self.finetuning_type}, but "
                   f"{'the adapter ' + adapter + ' is given' if adapter else 'no adapter is given'}; {advice}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_merged_policy(model_name_or_path: str, adapter: str | None = None, *, device: str = "cpu",
                       cache_dir: str | None = None, trust_remote_code: bool = False,
                       field: str = "model_name_or_path") -> PolicyModel:
    """A model with its LoRA adapter (an adapter output folder, or ``adapter`` over a base) merged into the weights:
    what an export writes and what eval and chat run."""
    if adapter is None:
        policy = PolicyModel.from_pretrained(model_name_or_path, device=device, cache_dir=cache_dir,
                                             trust_remote_code=trust_remote_code, is_trainable=False, field=field)
    else:
        policy = _policy_with_adapter(model_name_or_path, adapter, device, cache_dir, trust_remote_code)
    if policy.is_peft:
        with _peft_deprecation_quiet():
            policy.model = policy.model.merge_and_unload()
    policy.model.eval()
    return policy


def _policy_with_adapter(base: str, adapter: str, device: str, cache_dir: str | None,
                         trust_remote_code: bool = False) -> PolicyModel:
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").exists():
        raise RLHFInputError(f"config field 'adapter_name_or_path': {adapter} has no adapter_config.json; give the "
                             f"output folder of a LoRA stage")
    policy = PolicyModel.from_pretrained(base, device=device, cache_dir=cache_dir, trust_remote_code=trust_remote_code,
                                         is_trainable=False)
    with _peft_deprecation_quiet():
        policy.model = PeftModel.from_pretrained(policy.model, adapter, is_trainable=False)
    if (Path(adapter) / "tokenizer_config.json").exists():  # the tokenizer (and template) the adapter trained with
        policy.tokenizer = load_tokenizer(adapter, trust_remote_code)
    return policy


def _export_device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def export_model(config: ExportConfig) -> Path:
    """Write the export ``config`` describes; returns the folder (hf) or the .gguf file (gguf)."""
    policy = load_merged_policy(config.model_name_or_path, config.adapter_name_or_path,
                                device=_export_device(config.export_device), cache_dir=config.cache_dir,
                                trust_remote_code=config.trust_remote_code)
    policy.model.to("cpu")
    formatter = ChatFormatter(policy.tokenizer, config.template, enable_thinking=config.enable_thinking,
                              generation_config=policy.model.generation_config, vision=policy.vision)
    target = Path(config.export_dir)
    with saved_as_trained(policy.model, policy.tokenizer, formatter):
        if config.export_format == "hf":
            _write_folder_atomically(target, lambda tmp: _save_hf(policy, tmp, config.export_size))
            return target
        target.mkdir(parents=True, exist_ok=True)
        name = f"{_export_name(config.model_name_or_path, config.adapter_name_or_path)}-{config.gguf_type}.gguf"
        path = target / name
        write_gguf(policy.model, policy.tokenizer, path, config.gguf_type,
                   name=_export_name(config.model_name_or_path, config.adapter_name_or_path))
        return path


def _save_hf(policy: PolicyModel, directory: Path, export_size: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model = innermost_model(policy.model)
    model.save_pretrained(directory, max_shard_size=f"{export_size}GB")
    policy.tokenizer.save_pretrained(directory)
    if policy.vision is not None:
        policy.vision.save_pretrained(directory, policy.tokenizer)


def _write_folder_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a temporary sibling, then swap it in: a reader never sees half an export, and an export that
    fails leaves the previous one."""
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _export_name(model: str, adapter: str | None) -> str:
    source = Path(adapter or model)
    name = source.stem if source.suffix == ".gguf" else source.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name or "model")


# -- GGUF out. llama.cpp's conventions (its convert_hf_to_gguf.py): tensors named by gguf's TensorNameMap, Llama's
# q/k rows permuted to its rope layout, Gemma's norms stored as 1 + weight, 2-D weights in the chosen type and 1-D
# ones (norms, biases) in f32; the tokenizer as token, type, score and merge lists. transformers reads such a file
# back (from_pretrained(gguf_file=...)), which the tests use as the independent check.


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one Hugging Face model type is written: the GGUF architecture name, whether q/k rows are permuted
    (llama.cpp's interleaved rope for Llama), the shift of norm weights (Gemma), and the keys it needs."""

    gguf_name: str
    permute_qk: bool = False
    norm_shift: float = 0.0
    head_dim_keys: bool = False  # key_length / value_length (models whose head_dim is not hidden / heads)
    sliding_window: bool = False


GGUF_EXPORT_ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", permute_qk=True),
    "mistral": GGUFArchitecture("llama", permute_qk=True),
    "qwen2": GGUFArchitecture("qwen2"),
    "qwen3": GGUFArchitecture("qwen3", head_dim_keys=True),
    "gemma3_text": GGUFArchitecture("gemma3", norm_shift=1.0, head_dim_keys=True, sliding_window=True),
}
(GGUF_TOKEN_NORMAL, GGUF_TOKEN_UNKNOWN, GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED, GGUF_TOKEN_UNUSED,
 GGUF_TOKEN_BYTE) = 1, 2, 3, 4, 5, 6  # llama.cpp's token types


def _gguf_architecture(config: Any) -> GGUFArchitecture:
    model_type = getattr(config, "model_type", "?")
    if model_type not in GGUF_EXPORT_ARCHITECTURES:
        raise RLHFInputError(f"export_format gguf: model type '{model_type}' cannot be written as GGUF here "
                             f"(supported: {', '.join(GGUF_EXPORT_ARCHITECTURES)}); export format hf and convert it "
                             "with llama.cpp's convert_hf_to_gguf.py")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_types = {rope.get("rope_type", "default")} if "rope_type" in rope or not rope else \
        {r.get("rope_type", "default") for r in rope.values() if isinstance(r, dict)}
    if rope_types - {"default"}:
        raise RLHFInputError(f"export_format gguf: this {model_type} model uses {', '.join(sorted(rope_types))} rope "
                             f"scaling, which the GGUF writer does not carry; export format hf and convert it with "
                             f"llama.cpp's convert_hf_to_gguf.py")
    if model_type == "gemma3_text":
        # what GGUF readers derive instead of reading: llama.cpp scales queries by 1/sqrt(head_dim) and transformers by
        # its default query_pre_attn_scalar (256); both use local rope base 10000 and a full-attention layer every 6th
        layers = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                  for i in range(config.num_hidden_layers)]
        local = (rope.get("sliding_attention") or {}).get("rope_theta",
                                                          getattr(config, "rope_local_base_freq", 10000.0))
        if not (config.query_pre_attn_scalar == config.head_dim == 256) or float(local) != 10000.0 \
                or list(getattr(config, "layer_types", layers)) != layers:
            raise RLHFInputError("export_format gguf: this Gemma 3's query scaling (query_pre_attn_scalar and head_dim "
                                 "other than 256), local rope base or layer pattern differs from what GGUF readers "
                                 "assume for Gemma 3; export format hf")
    return GGUF_EXPORT_ARCHITECTURES[model_type]


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        return float(rope["rope_theta"])
    if "full_attention" in rope:
        return float(rope["full_attention"].get("rope_theta", 10000.0))
    return float(getattr(config, "rope_theta", 10000.0))


def gguf_hyperparameters(config: Any, arch: GGUFArchitecture) -> dict[str, Any]:
    """``{arch}.*`` metadata of a transformers config, under llama.cpp's key names."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    values = {"context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
              "block_count": config.num_hidden_layers, "feed_forward_length": config.intermediate_size,
              "attention.head_count": heads,
              "attention.head_count_kv": getattr(config, "num_key_value_heads", None) or heads,
              "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps), "rope.freq_base": _rope_theta(config),
              "rope.dimension_count": head_dim, "vocab_size": config.vocab_size}
    if arch.head_dim_keys:
        values.update({"attention.key_length": head_dim, "attention.value_length": head_dim})
    if arch.sliding_window and getattr(config, "sliding_window", None):
        values["attention.sliding_window"] = config.sliding_window
    return values


def permute_for_gguf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order for a Llama q or k projection (``heads`` of them): within each head, the rotary pairs
    (i, i + d/2) of Hugging Face's rotate-half layout become adjacent rows (2i, 2i + 1), as its rope expects.
    Shapes: (heads * d, hidden) -> the same."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _gguf_tensors(model: nn.Module, arch: GGUFArchitecture) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, fp32 tensor) for every weight the file holds; a tied output head is written once."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.gguf_name.upper()], config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads, kv_heads = (config.num_attention_heads,
                       getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        stem, _, suffix = hf_name.rpartition(".")
        gguf_stem = names.get_name(stem)
        if gguf_stem is None:
            raise RLHFInputError(f"export_format gguf: no GGUF name for tensor {hf_name} of {type(model).__name__}; "
                                 f"export format hf")
        tensor = tensor.detach().float().cpu()
        if arch.permute_qk and stem.endswith("q_proj"):
            tensor = permute_for_gguf(tensor, heads)
        elif arch.permute_qk and stem.endswith("k_proj"):
            tensor = permute_for_gguf(tensor, kv_heads)
        if arch.norm_shift and stem.endswith("norm"):
            tensor = tensor + arch.norm_shift
        yield f"{gguf_stem}.{suffix}", tensor


def _gguf_encoded(tensor: torch.Tensor, gguf_type: str) -> tuple[np.ndarray, Any]:
    """The tensor's data in ``gguf_type`` and its GGML type. 1-D tensors stay f32; q8_0 needs rows of a multiple of
    32 values (its block), so a 2-D tensor with other rows falls back to f16, as llama.cpp's converter does."""
    import gguf

    data = tensor.numpy()
    kinds = gguf.GGMLQuantizationType
    if data.ndim < 2 or gguf_type == "f32":
        return data.astype(np.float32), kinds.F32
    if gguf_type == "q8_0" and data.shape[-1] % 32 == 0:
        return gguf.quants.quantize(data, kinds.Q8_0), kinds.Q8_0
    if gguf_type == "bf16":
        return gguf.quants.quantize(data, kinds.BF16), kinds.BF16
    return data.astype(np.float16), kinds.F16


def _gguf_pre_tokenizer(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name of a byte-level tokenizer's pre-tokenizer (its `tokenizer.ggml.pre`), found by the split
    regex the tokenizer applies: transformers' table of llama.cpp's names and regexes is the reference."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    def parts(node: dict[str, Any] | None) -> list[dict[str, Any]]:
        if not node:
            return []
        return ([p for child in node.get("pretokenizers", []) for p in parts(child)] if node["type"] == "Sequence"
                else [node])

    steps = parts(tokenizer_json.get("pre_tokenizer"))
    kinds = [step["type"] for step in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    pattern = next((s["pattern"].get("Regex") for s in steps if s["type"] == "Split"), None)
    preferred = ("llama-bpe", "qwen2", "tekken", "gpt-4o")
    for name in sorted(GGUF_PRE_TOKENIZER_SPLITS,
                       key=lambda n: (n not in preferred, preferred.index(n) if n in preferred else 0)):
        if pattern is not None and GGUF_PRE_TOKENIZER_SPLITS[name] == pattern:
            return name
    logger.warning("export: the tokenizer's pre-tokenizer %s has no llama.cpp name; written as 'default'", kinds)
    return "default"


def gguf_vocabulary(tokenizer: Any, vocab_size: int, arch: GGUFArchitecture) -> dict[str, Any]:
    """The tokenizer as GGUF metadata (``tokenizer.ggml.*`` and the chat template): byte-level BPE as model 'gpt2'
    with its merges and pre-tokenizer, SentencePiece-style BPE (byte fallback) as 'llama' with scores that rank
    pieces by id. Ids the tokenizer does not fill up to the model's ``vocab_size`` become unused [PADn] entries."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise RLHFInputError(f"export_format gguf: a {model.get('type')} tokenizer cannot be written here (byte-level "
                             f"or SentencePiece BPE only); export format hf")
    sentencepiece = bool(model.get("byte_fallback"))
    tokens: list[str | None] = [None] * vocab_size
    types = [GGUF_TOKEN_NORMAL] * vocab_size
    for token, index in model["vocab"].items():
        if index < vocab_size:
            tokens[index] = token
    for added in state.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = GGUF_TOKEN_CONTROL if added["special"] else GGUF_TOKEN_USER_DEFINED
    for index, token in enumerate(tokens):
        if token is None:
            tokens[index], types[index] = f"[PAD{index}]", GGUF_TOKEN_UNUSED
        elif sentencepiece and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            types[index] = GGUF_TOKEN_BYTE
        elif sentencepiece and arch.norm_shift and len(token) > 1 and set(token) == {"\u2581"}:
            tokens[index] = " " * len(token)  # Gemma files spell whitespace runs with spaces (its SentencePiece model)
    unk = tokenizer.unk_token_id
    if unk is not None and unk < vocab_size and types[unk] == GGUF_TOKEN_NORMAL:
        types[unk] = GGUF_TOKEN_UNKNOWN
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    encoded = tokenizer("a").input_ids
    fields: dict[str, Any] = {
        "model": "llama" if sentencepiece else "gpt2", "tokens": tokens, "token_type": types, "merges": merges,
        "add_bos_token": bool(tokenizer.bos_token_id is not None and encoded[:1] == [tokenizer.bos_token_id]),
        "add_eos_token": bool(tokenizer.eos_token_id is not None and encoded[-1:] == [tokenizer.eos_token_id]
                              and len(encoded) > 1),
        "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None}
    if sentencepiece:
        fields["scores"] = [-float(i) if t == GGUF_TOKEN_NORMAL else -1000.0 for i, t in enumerate(types)]
        fields["add_space_prefix"] = False
    else:
        fields["pre"] = _gguf_pre_tokenizer(state)
    for name in ("bos", "eos", "unk", "pad"):
        index = getattr(tokenizer, f"{name}_token_id")
        if index is not None and index < vocab_size:
            fields[f"{name}_token_id"] = index
    return fields


def write_gguf(model: nn.Module, tokenizer: Any, path: str | os.PathLike, gguf_type: str = "f16", *,
               name: str = "model") -> Path:
    """Write ``model`` (a Hugging Face causal LM of a GGUF_EXPORT_ARCHITECTURES type, adapters merged) and its
    tokenizer as one GGUF file of ``gguf_type`` (f32 | f16 | bf16 | q8_0), atomically."""
    gguf = _gguf_module("export_format gguf")
    _check_choice(gguf_type, GGUF_TYPES, "gguf_type")
    model = innermost_model(model)
    config = model.config
    arch = _gguf_architecture(config)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    writer = gguf.GGUFWriter(str(tmp), arch.gguf_name)
    try:
        writer.add_name(name)
        file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                      "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
        writer.add_file_type(file_types[gguf_type])
        if gguf_type == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value in gguf_hyperparameters(config, arch).items():
            full = f"{arch.gguf_name}.{key}"
            if isinstance(value, float):
                writer.add_float32(full, value)
            else:
                writer.add_uint32(full, int(value))
        vocabulary = gguf_vocabulary(tokenizer, config.vocab_size, arch)
        writer.add_tokenizer_model(vocabulary["model"])
        if "pre" in vocabulary:
            writer.add_tokenizer_pre(vocabulary["pre"])
        writer.add_token_list(vocabulary["tokens"])
        writer.add_token_types(vocabulary["token_type"])
        if "scores" in vocabulary:
            writer.add_token_scores(vocabulary["scores"])
            writer.add_add_space_prefix(vocabulary["add_space_prefix"])
        if vocabulary["merges"]:
            writer.add_token_merges(vocabulary["merges"])
        setters = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
                   "pad": writer.add_pad_token_id}
        for key, setter in setters.items():
            if f"{key}_token_id" in vocabulary:
                setter(vocabulary[f"{key}_token_id"])
        writer.add_add_bos_token(vocabulary["add_bos_token"])
        writer.add_add_eos_token(vocabulary["add_eos_token"])
        if vocabulary["chat_template"]:
            writer.add_chat_template(vocabulary["chat_template"])
        for tensor_name, tensor in _gguf_tensors(model, arch):
            data, kind = _gguf_encoded(tensor, gguf_type)
            quantized = kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            writer.add_tensor(tensor_name, data, raw_dtype=kind if quantized else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---- Evaluation of any model on a dataset: the pipeline's evaluator, as a command ----


@dataclass
class EvalConfig:
    """Measure a model (or an adapter) on a dataset with the pipeline's evaluator; writes output_dir/eval.json."""

    model_name_or_path: str = _opt("", "The model to measure: an output folder (an adapter loads its base), a Hugging "
                                       "Face folder, a .gguf file or 'tiny'")
    gguf_file: str | None = _opt(None, "A GGUF file inside the model_name_or_path folder")
    adapter_name_or_path: str | None = _opt(None, "A LoRA adapter folder applied over model_name_or_path")
    dataset: str = _opt("", "Prompts to answer, with an 'answer' for held-out accuracy (dataset names in "
                            "dataset_dir/dataset_info.json or files, comma-separated)")
    dataset_dir: str = _opt("data", "Folder holding dataset_info.json and the files it names")
    max_samples: int | None = _opt(None, "Use at most this many records of each dataset")
    template: str = _opt("auto", "Chat template the prompts are rendered with (as in training)")
    enable_thinking: bool | None = _opt(None, "Thinking switch of templates that have one")
    max_new_tokens: int = _opt(64, "Token budget per answer")
    batch_size: int = _opt(32, "Prompts per generation batch")
    reward_model: str | None = _opt(None, "A reward model (rm stage output): its mean score of the greedy answers "
                                          "(reward/mean)")
    ref_model: str | None = _opt(None, "A reference model: KL(model || reference) on sampled answers (kl/k1, kl/k3)")
    compare_model: str | None = _opt(None, "Another model: win rate of this model's greedy answers over its answers, "
                                           "judged by reward_model if given, else by correctness")
    max_prompts: int = _opt(100, "Prompts used for the sampled measures (KL) and the win rate (accuracy uses every "
                                 "prompt)")
    samples_per_prompt: int = _opt(4, "Samples per prompt for the KL estimate")
    output_dir: str = _opt("outputs/eval", "Where eval.json is written")
    seed: int = _opt(42, "Seed of the sampled measures")
    trust_remote_code: bool = _opt(False, "Allow custom modelling code shipped with the model")
    cache_dir: str | None = _opt(None, "Cache of the embedded model and GGUF conversions")

    stage: typing.ClassVar[str] = "eval"

    def __post_init__(self) -> None:
        _check(bool(str(self.model_name_or_path).strip()), "model_name_or_path", "is empty; name the model to measure")
        _check(bool(str(self.dataset).strip()), "dataset", "is empty; name prompts to answer (with an 'answer' each)")
        if self.gguf_file:
            self.model_name_or_path, self.gguf_file = str(Path(self.model_name_or_path) / self.gguf_file), None
        for name in ("max_new_tokens", "batch_size", "max_prompts", "samples_per_prompt"):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _correctness(policy: PolicyModel, formatter: ChatFormatter, records: list[dict[str, Any]],
                 config: EvalConfig) -> list[float]:
    """1.0 where the greedy answer's ``Answer:`` line equals the record's answer, else 0.0."""
    prompts = [formatter.prompt_ids(r) for r in records]
    completions = policy.generate(prompts, max_new_tokens=config.max_new_tokens,
                                  stop_token_ids=formatter.stop_token_ids, batch_size=config.batch_size)
    return [float(_answer_matches(policy.decode(c), r)) for c, r in zip(completions, records)]


def evaluate_model(config: EvalConfig) -> dict[str, Any]:
    """Every measure the config allows, written to ``output_dir/eval.json``: held-out accuracy and format rate (records
    with an answer), the reward model's mean score, KL to a reference, win rate over another model."""
    set_seed(config.seed)
    records = load_records(config.dataset, config.dataset_dir, "prompt", max_samples=config.max_samples)
    load = functools.partial(load_merged_policy, cache_dir=config.cache_dir, trust_remote_code=config.trust_remote_code)
    started = time.time()
    policy = load(config.model_name_or_path, config.adapter_name_or_path)
    reference = load(config.ref_model, field="ref_model") if config.ref_model else None
    evaluator = RLHFEvaluator(policy, reference, template=config.template, max_new_tokens=config.max_new_tokens,
                              batch_size=config.batch_size, seed=config.seed, enable_thinking=config.enable_thinking)
    metrics: dict[str, float] = {}
    answered = [r for r in records if r.get("answer") is not None]
    if answered:
        metrics.update(evaluate_exact_match(policy, evaluator.formatter, answered,
                                            max_new_tokens=config.max_new_tokens, batch_size=config.batch_size))
    subset = records[:config.max_prompts]
    reward_fn = None
    if config.reward_model:
        learned = LearnedReward.from_pretrained(config.reward_model, template=config.template,
                                                enable_thinking=config.enable_thinking)
        reward_fn = lambda prompts, responses: learned(prompts, responses, [None] * len(prompts))  # noqa: E731
        metrics.update(evaluator.mean_reward(subset, reward_fn))
    if reference is not None:
        metrics.update(evaluator.kl_to_reference(subset, config.samples_per_prompt))
    if config.compare_model:
        other = load(config.compare_model, field="compare_model")
        if reward_fn is not None:
            evaluator.reference = other
            metrics.update(evaluator.win_rate(subset, reward_fn=reward_fn))
            evaluator.reference = reference
        else:
            judged = [r for r in subset if r.get("answer") is not None]
            if not judged:
                raise RLHFInputError("config field 'compare_model': a win rate needs a reward_model or prompts with an "
                                     "'answer' to judge correctness by")
            other_formatter = ChatFormatter(other.tokenizer, config.template, enable_thinking=config.enable_thinking,
                                            generation_config=other.model.generation_config)
            result = win_rate(_correctness(policy, evaluator.formatter, judged, config),
                              _correctness(other, other_formatter, judged, config))
            metrics.update({f"win/{k}": float(v) for k, v in result.items()})
    report = {"model": config.model_name_or_path, "adapter": config.adapter_name_or_path, "dataset": config.dataset,
              "prompts": len(records), "answered": len(answered), "seconds": round(time.time() - started, 2),
              "metrics": metrics, "config": config.to_dict()}
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(output / "eval.json", report, indent=2)
    return report


def eval_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"eval: {report['model']} on {report['dataset']} ({report['prompts']} prompts, "
                        f"{report['seconds']:.0f}s)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in report["metrics"].items():
        percent = name in ("eval/accuracy", "eval/format_rate", "win/win_rate")
        table.add_row(name, _metric_cell(value, percent=percent) if isinstance(value, float) else str(value))
    return table


# ---- Chat: a conversation with a model, through the chat template it trained with ----


@dataclass
class ChatConfig:
    """Talk to a model in the terminal, rendered with its chat template, the reply streamed token by token."""

    model_name_or_path: str = _opt("", "The model: an output folder (an adapter loads its base), a Hugging Face "
                                       "folder, a .gguf file or 'tiny'")
    adapter_name_or_path: str | None = _opt(None, "A LoRA adapter folder applied over model_name_or_path")
    template: str = _opt("auto", "Chat template (as in training)")
    enable_thinking: bool | None = _opt(None, "Thinking switch of templates that have one")
    system: str = _opt("", "System prompt of every turn ('' : none, or the template's default)")
    max_new_tokens: int = _opt(256, "Token budget per reply")
    temperature: float = _opt(0.7, "Sampling temperature (0: greedy)")
    top_p: float = _opt(0.9, "Nucleus sampling: smallest set of tokens with this much probability")
    seed: int = _opt(42, "Seed of the sampling")
    trust_remote_code: bool = _opt(False, "Allow custom modelling code shipped with the model")
    cache_dir: str | None = _opt(None, "Cache of the embedded model and GGUF conversions")

    stage: typing.ClassVar[str] = "chat"

    def __post_init__(self) -> None:
        _check(bool(str(self.model_name_or_path).strip()), "model_name_or_path",
               "is empty; name the model to chat with")
        _check(self.max_new_tokens > 0, "max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")


CHAT_HELP = "/reset clears the conversation, /system TEXT sets the system prompt, /exit (or Ctrl-D) leaves"


class ChatSession:
    """A conversation: the history of turns, rendered whole by the formatter at every turn (so the prompt is exactly
    what the template writes for the conversation so far), each reply streamed to ``write`` as it is decoded."""

    def __init__(self, policy: PolicyModel, formatter: ChatFormatter, config: ChatConfig) -> None:
        self.policy, self.formatter, self.config = policy, formatter, config
        self.system = config.system
        self.history: list[dict[str, str]] = []

    def prompt_ids(self, message: str) -> list[int]:
        return self.formatter.prompt_ids({"system": self.system,
                                          "messages": [*self.history, {"role": "user", "content": message}]})

    @torch.no_grad()
    def reply(self, message: str, write: Callable[[str], None]) -> str:
        """Answer ``message`` in the conversation so far, streaming the text to ``write``; the turn joins the
        history."""
        from transformers import TextStreamer

        class _Stream(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                write(text)

        ids = torch.tensor([self.prompt_ids(message)], device=self.policy.device)
        greedy = self.config.temperature == 0
        sampling = {} if greedy else {"temperature": self.config.temperature, "top_p": self.config.top_p, "top_k": 0}
        output = innermost_model(self.policy.model).generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.config.max_new_tokens,
            do_sample=not greedy, eos_token_id=list(self.formatter.stop_token_ids),
            pad_token_id=self.policy.tokenizer.pad_token_id,
            streamer=_Stream(self.policy.tokenizer, skip_prompt=True, skip_special_tokens=True), **sampling)
        text = self.policy.decode(output[0, ids.shape[1]:].tolist()).strip()
        self.history += [{"role": "user", "content": message}, {"role": "assistant", "content": text}]
        return text

    def run(self, read: Callable[[str], str] | None = None, write: Callable[[str], None] | None = None) -> int:
        """The read-reply loop until /exit or end of input (``read``: a line of input, default ``input``); returns
        the number of replies."""
        read = read or (lambda prompt: input(prompt))
        write = write or (lambda text: print(text, end="", flush=True))
        replies = 0
        while True:
            try:
                line = read("you> ").strip()
            except EOFError:
                write("\n")
                return replies
            if not line:
                continue
            if line in ("/exit", "/quit"):
                return replies
            if line == "/reset":
                self.history = []
                write("(conversation cleared)\n")
                continue
            if line.startswith("/system"):
                self.system = line[len("/system"):].strip()
                write(f"(system prompt {'set' if self.system else 'cleared'})\n")
                continue
            if line.startswith("/"):
                write(f"(unknown command {line.split()[0]}; {CHAT_HELP})\n")
                continue
            write("model> ")
            self.reply(line, write)
            write("\n")
            replies += 1


def chat(config: ChatConfig, read: Callable[[str], str] | None = None,
         write: Callable[[str], None] | None = None) -> int:
    """Load the model (its adapter merged) and run a ChatSession until /exit; returns the number of replies."""
    set_seed(config.seed)
    policy = load_merged_policy(config.model_name_or_path, config.adapter_name_or_path, cache_dir=config.cache_dir,
                                trust_remote_code=config.trust_remote_code)
    formatter = ChatFormatter(policy.tokenizer, config.template, enable_thinking=config.enable_thinking,
                              generation_config=policy.model.generation_config)
    (write or (lambda text: print(text, end="", flush=True)))(f"chat with {config.model_name_or_path} ({CHAT_HELP})\n")
    return ChatSession(policy, formatter, config).run(read, write)


# ==== 15. CLI ====

PIPELINE_HELP = """\
The pipeline YAML holds keys shared by every stage at the top level, `stages: [sft, ...]`, and one
section per stage (e.g. `sft:`) whose keys override the shared ones. Each stage writes to
output_dir/<stage>, logs to output_dir/logs/<stage>.log and starts from the previous stage's model;
report.json collects every stage, report.md and pipeline_summary.png summarise the run.
Overrides: key=value applies to all stages, sft.key=value to one stage, best_of_n.n=4 to a final stage.
Re-running skips stages already complete for the same config, data and input models, and resumes an
interrupted one from its latest checkpoint.

Pipeline keys:
{pipeline_keys}

Final stages (after training; name models by the stage that produced them, e.g. reference: sft):
{final_stages}

Stage options (see `python rlhf.py sft --help` for each one's meaning):
"""


def _pipeline_help() -> str:
    keys = "\n".join(f"  {f.name}: {f.metadata.get('help', '')}" for f in dataclasses.fields(PipelineConfig)
                     if f.name in ("capability_tests", "capability_threshold", "rollback_on_error"))
    finals = "\n".join(f"  {stage}:\n" + "\n".join(f"    {key} (default {value}): {FINAL_STAGE_HELP[stage][key]}"
                                                   for key, value in options.items())
                       for stage, options in FINAL_STAGE_OPTIONS.items())
    return PIPELINE_HELP.format(pipeline_keys=keys, final_stages=finals)


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence, for a one-line help entry (its first paragraph may wrap over lines)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = re.search(r"\.(\s+[A-Z]|$)", paragraph)  # not at "et al. 2019"
    return paragraph[:end.start() + 1] if end else paragraph


def _build_parser() -> Any:
    parser = argparse.ArgumentParser(prog="rlhf", description="Post-training for causal language models: "
                                     "SFT, reward and process-reward models, DPO/SimPO/ORPO/KTO, online RL (GRPO, "
                                     "RLOO, REINFORCE++, online DPO, distillation, PPO).",
                                     epilog="LLaMA-Factory style: `rlhf --config FILE` and `rlhf train FILE` run the "
                                     "stage named by the file's `stage:` key.\n`rlhf COMMAND --help` lists every "
                                     "option of a command.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rlhf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_commands in (_add_training_commands, _add_plan_command, _add_model_commands, _add_model_use_commands):
        add_commands(sub)  # in this order: the order of --help's list of commands
    return parser


def _add_training_commands(sub: Any) -> None:
    """One command per stage, ``pipeline`` and ``train`` (LLaMA-Factory's: the file names the stage)."""
    for stage, cls in STAGE_CONFIGS.items():
        command = sub.add_parser(stage, help=_first_sentence(cls.__doc__ or ""),
                                 description=f"Train the {stage} stage. Options come from --config (YAML, "
                                 "LLaMA-Factory keys accepted) and key=value overrides, in that order.",
                                 epilog="options (YAML keys or key=value):\n" + config_help(cls),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_argument("--config", help="YAML config file")
        command.add_argument("overrides", nargs="*", metavar="key=value",
                             help="override one option, e.g. learning_rate=1e-4")
    pipeline = sub.add_parser("pipeline", help="Run several stages in order from one YAML file",
                              description="Run the stages listed in the config, in order, then print a summary table.",
                              epilog=_pipeline_help() + "\n".join(f"[{s}]\n{config_help(c)}"
                                                                  for s, c in STAGE_CONFIGS.items()),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    pipeline.add_argument("--config", required=True, help="pipeline YAML (see configs/demo.yaml)")
    pipeline.add_argument("--preset", choices=sorted(PRESET_ARCHITECTURES), default=None,
                          help="start from the 7B/70B preset's settings; the YAML adds data and overrides "
                          "(see configs/real_model.yaml)")
    pipeline.add_argument("overrides", nargs="*", metavar="key=value", help="shared or stage.key=value overrides")
    train = sub.add_parser("train", help="LLaMA-Factory style: run the stage named by the config's `stage:` key",
                           description="Read `stage:` from a LLaMA-Factory style YAML file and run that stage: "
                           "`rlhf train FILE` or `rlhf train --config FILE` (the same).")
    train.add_argument("--config", required=True, help="YAML config with a `stage:` key (or give FILE first, "
                       "without --config)")
    train.add_argument("overrides", nargs="*", metavar="key=value")


def _add_plan_command(sub: Any) -> None:
    """``plan``: per-GPU memory of a preset, before launching."""
    plan = sub.add_parser("plan", help="Estimate per-GPU memory of a 7B/70B preset before launching",
                          description="Per-GPU memory of one training step of a preset (weights, gradients, "
                          "optimizer states, activations, reference and reward models), by mixed-precision "
                          "accounting (see rlhf.estimate_memory); excludes the CUDA context and generation KV cache.")
    plan.add_argument("--preset", choices=sorted(PRESET_ARCHITECTURES), default="7b",
                      help="model size, and the batch and sequence length of its preset (default 7b)")
    plan.add_argument("--model", default=None, help="a model directory (or hub id) whose config.json gives the sizes "
                      "instead of the preset's; a vision-language model's vision tower and projector are counted")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs sharing the model (ZeRO-3 / FSDP; default 8)")
    plan.add_argument("--finetuning-type", choices=("lora", "full"), default="lora", help="LoRA (default) or full")
    plan.add_argument("--stage", choices=("sft", "rm", "dpo", "grpo", "ppo"), default=None,
                      help="one stage (default: every stage of the preset, plus ppo)")
    plan.add_argument("--no-sharding", action="store_true", help="plain DDP: every GPU holds everything")
    plan.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU to check against (default 80)")


def _add_model_commands(sub: Any) -> None:
    """Commands that make models from models without training: ``combine-rm``, ``merge`` (model_merging), and
    ``vllm-serve``, which serves one."""
    import model_merging

    combine = sub.add_parser("combine-rm", help="Write a reward-model ensemble from existing reward models",
                             description="Write DIR/ensemble.json listing every member of the given reward models "
                             "or ensembles (rm stage outputs) by relative path; nothing is copied. Reward, PPO, "
                             "Best-of-N and best-of-n take DIR like any reward model and score by the members' "
                             "mean. Models trained from different backbones err on different pairs, so their "
                             "mean ranks more pairs right than either alone.")
    combine.add_argument("--out", required=True, help="the ensemble directory to write (created if missing)")
    combine.add_argument("sources", nargs="+", metavar="DIR", help="reward-model or ensemble directories")
    sub.add_parser("vllm-serve", add_help=False, help="Serve rollouts with vLLM for vllm_mode: server "
                   "(`rlhf vllm-serve --help` lists its options)")
    merge = sub.add_parser("merge", help="Merge fine-tuned checkpoints (TIES, DARE, SLERP, ...) with model_merging.py",
                           description="Merge checkpoint directories tensor by tensor into a new Hugging Face "
                           "directory; the same as `python model_merging.py --config FILE`. Example configs: "
                           "configs/merge_*.yaml.", epilog=model_merging.CONFIG_KEYS_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    merge.add_argument("--config", required=True, help="merge YAML (method, base_model, models, output_dir, ...)")
    merge.add_argument("overrides", nargs="*", metavar="key=value", help="override a top-level key, e.g. density=0.3")
    merge.add_argument("--dry-run", action="store_true", help="check the config and inputs, write nothing")
    merge.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_model_use_commands(sub: Any) -> None:
    """``export``, ``eval`` and ``chat``: a trained model written out, measured, talked to."""
    export = sub.add_parser("export",
                            help="Merge an adapter into its base and write a Hugging Face folder or a GGUF file",
                            description="Export a trained model: a LoRA adapter merged into its base, written as a "
                            "Hugging Face folder (safetensors) or, with --format gguf, one GGUF file for llama.cpp, "
                            "Ollama and LM Studio. LLaMA-Factory's export keys work: `rlhf export FILE` reads them.",
                            epilog="options (YAML keys or key=value):\n" + config_help(ExportConfig),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("--config", help="YAML config (model_name_or_path, adapter_name_or_path, export_dir, ...)")
    export.add_argument("--format", choices=EXPORT_FORMATS, default=None, help="hf or gguf (export_format)")
    export.add_argument("--gguf-type", choices=GGUF_TYPES, default=None, help="GGUF tensor type (gguf_type)")
    export.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. export_dir=outputs/export")
    evaluate = sub.add_parser("eval", help="Measure a model or adapter on a dataset; writes eval.json",
                              description="Held-out accuracy and format rate (prompts with an 'answer'), a reward "
                              "model's score, KL to a reference and win rate over another model: the pipeline's "
                              "evaluator on any model. Writes output_dir/eval.json and prints a table.",
                              epilog="options (YAML keys or key=value):\n" + config_help(EvalConfig),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    evaluate.add_argument("--config", help="YAML config")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value",
                          help="e.g. model_name_or_path=outputs/sft dataset=demo_eval dataset_dir=data/demo")
    talk = sub.add_parser("chat", help="Talk to a model in the terminal, with its chat template, the reply streamed",
                          description="An interactive conversation with a model: every turn is rendered with the "
                          f"chat template (the history included) and the reply streams as it is decoded. {CHAT_HELP}.",
                          epilog="options (flags, or key=value):\n" + config_help(ChatConfig),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    talk.add_argument("model", nargs="?", default=None, help="the model (model_name_or_path)")
    talk.add_argument("--adapter", default=None, help="a LoRA adapter folder over the model")
    talk.add_argument("--system", default=None, help="system prompt")
    talk.add_argument("--max-new-tokens", type=int, default=None, help="token budget per reply (default 256)")
    talk.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature, 0 for greedy (default 0.7)")
    talk.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default 0.9)")
    talk.add_argument("--template", default=None, help="chat template (default: the model's own)")
    talk.add_argument("--config", help="YAML config")
    talk.add_argument("overrides", nargs="*", metavar="key=value", help="any option as key=value")


def memory_plan_table(args: Any) -> Any:
    """The ``plan`` command's table: one column per stage, GiB per GPU, and whether it fits."""
    from rich.table import Table

    if args.gpus < 1:
        raise RLHFInputError(f"--gpus {args.gpus}: need at least 1 GPU")
    preset = (get_7b_model_config if args.preset == "7b" else get_70b_model_config)(args.finetuning_type)
    stages = [args.stage] if args.stage else [*preset.stages, "ppo"]
    columns = {}
    arch = model_architecture(args.model) if args.model else PRESET_ARCHITECTURES[args.preset]
    for stage in stages:
        config = preset.stage_config(stage if stage in preset.stages else "grpo")
        columns[stage] = estimate_memory(arch, gpus=args.gpus,
                                         finetuning_type=args.finetuning_type, lora_rank=config.lora_rank,
                                         batch=config.per_device_train_batch_size, seq_len=config.cutoff_len,
                                         gradient_checkpointing=config.gradient_checkpointing,
                                         sharded=not args.no_sharding, stage=stage)
    vision = f", vision {arch['vision_parameters'] / 1e9:.2f}B frozen" if arch.get("vision_parameters") else ""
    table = Table(min_width=78,
                  title=f"{arch['model']} ({count_parameters(arch) / 1e9:.1f}B{vision}), {args.finetuning_type}, "
                        f"{args.gpus} GPU(s){'' if args.no_sharding else ' sharded (ZeRO-3 / FSDP)'}: GiB per GPU")
    table.add_column("component")
    for stage in stages:
        table.add_column(stage, justify="right")
    for row in next(iter(columns.values())):
        table.add_row(row, *(f"{columns[s][row]:.1f}" for s in stages), style="bold" if row == "total" else None)
    table.add_row(f"fits {args.gpu_memory:g} GiB?", *("yes" if columns[s]["total"] <= args.gpu_memory - 2 else "NO"
                                                   for s in stages))
    table.caption = ("batch and sequence length from the preset; +1-3 GiB CUDA context not included (the fit "
                     "check leaves 2 GiB); online stages also need their generation KV cache")
    return table


def _run_single_stage(stage: str, config_path: str | None, overrides: list[str]) -> list[dict[str, Any]]:
    config = load_config(STAGE_CONFIGS[stage], config_path, overrides)
    result = STAGE_RUNNERS[stage](config)
    entry = result.report_entry()
    append_report(config.output_dir, entry)
    return [entry]


def _llamafactory_argv(argv: list[str]) -> list[str]:
    """Accept the way LLaMA-Factory users type it: ``rlhf.py --config FILE`` and ``rlhf.py train FILE``
    both mean ``rlhf.py train --config FILE`` (the file's ``stage:`` key picks the trainer); ``export FILE`` and
    ``eval FILE`` read FILE as their config the same way."""
    if argv and (argv[0] == "--config" or argv[0].startswith("--config=")):
        return ["train", *argv]
    if len(argv) >= 2 and argv[0] in ("train", "export", "eval") and not argv[1].startswith("-") and "=" not in argv[1]:
        return [argv[0], "--config", *argv[1:]]
    return argv


def _chat_config(args: Any) -> ChatConfig:
    flags = {"model_name_or_path": args.model, "adapter_name_or_path": args.adapter, "system": args.system,
             "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "template": args.template}
    given = [f"{key}={json.dumps(value) if isinstance(value, str) else value}" for key, value in flags.items()
             if value is not None]
    return load_config(ChatConfig, args.config, [*args.overrides, *given])


def _export_config(args: Any) -> ExportConfig:
    flags = [f"export_format={args.format}"] if args.format else []
    flags += [f"gguf_type={args.gguf_type}"] if args.gguf_type else []
    return load_config(ExportConfig, args.config, [*args.overrides, *flags])


def _print_memory_plan(args: Any, console: Any) -> None:
    console.print(memory_plan_table(args))


def _combine_reward_models(args: Any, console: Any) -> None:
    names = RewardEnsemble.combine(args.out, args.sources)
    console.print(f"{args.out}/{RewardEnsemble.MANIFEST}: {len(names)} members ({', '.join(names)})")


def _export(args: Any, console: Any) -> None:
    config = _export_config(args)
    written = export_model(config)
    console.print(f"exported {config.model_name_or_path}"
                  f"{' + ' + config.adapter_name_or_path if config.adapter_name_or_path else ''} "
                  f"to {written} ({config.export_format}"
                  f"{', ' + config.gguf_type if config.export_format == 'gguf' else ''})")


def _evaluate(args: Any, console: Any) -> None:
    config = load_config(EvalConfig, args.config, args.overrides)
    report = evaluate_model(config)
    console.print(eval_table(report))
    console.print(f"written: {Path(config.output_dir) / 'eval.json'}")


def _chat(args: Any, console: Any) -> None:
    chat(_chat_config(args))


# the commands that train nothing: command -> fn(args, console), which prints its result
_COMMANDS_WITHOUT_TRAINING: dict[str, Callable[[Any, Any], None]] = {
    "plan": _print_memory_plan, "combine-rm": _combine_reward_models, "export": _export, "eval": _evaluate,
    "chat": _chat}


def _stage_to_train(args: Any) -> str:
    """The stage a training command runs: its name, or for ``train`` the file's ``stage:`` key, or stage=X on the
    command line (it wins)."""
    stage = args.command
    if stage == "train":
        given = [o.split("=", 1)[1].strip() for o in args.overrides if o.split("=", 1)[0].strip() == "stage"]
        stage = given[-1] if given else str(read_yaml(args.config).get("stage", ""))
        if not stage:
            raise RLHFInputError(f"{args.config} has no 'stage:' key, which picks the trainer; add a line "
                                 f"stage: {' | '.join(STAGE_CONFIGS)}, or give stage=sft (or another) after the "
                                 "file")
        if stage not in STAGE_CONFIGS:
            raise RLHFInputError(f"{args.config}: 'stage' is '{stage}'; valid: {', '.join(STAGE_CONFIGS)}")
    return stage


@_leaves_logging_as_found
def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; user mistakes print one line and exit with status 2."""
    from rich.console import Console
    from rich.markup import escape

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["vllm-serve"]:  # its own options (inference_optimizations.vllm_serve); starts no training

        setup_logging()
        return vllm_serve(argv[1:])
    args = _build_parser().parse_args(_llamafactory_argv(argv))
    kernels = pin_cpu_kernels()  # before any torch operation, so that a run's numbers do not depend on the CPU model
    console = rich_console()
    setup_logging()
    if kernels == "AVX2":
        logger.info("CPU kernels: AVX2 paths, the same results on any x86-64 CPU at the same thread count "
                    "(RLHF_CPU_KERNELS=native uses this CPU's widest)")
    if args.command == "merge":  # model_merging has its own one-line errors and exit status
        import model_merging

        return model_merging.main(["--config", args.config, *args.overrides, *(["--dry-run"] if args.dry_run else []),
                                   *(["--no-progress"] if args.no_progress else [])])
    finished = False
    try:
        if args.command in _COMMANDS_WITHOUT_TRAINING:
            _COMMANDS_WITHOUT_TRAINING[args.command](args, console)
            return 0
        if args.command == "pipeline":
            RLHFOrchestrator(PipelineConfig.load(args.config, args.overrides, args.preset)).run_full_pipeline()
            finished = True
            return 0
        entries = _run_single_stage(_stage_to_train(args), args.config, args.overrides)
        finished = True
        if _launch_rank() == 0:  # other processes hold no metric history (only the main process logs)
            console.print(summary_table(entries))
        return 0
    except (RLHFInputError, VLLMServerError) as err:  # a server that stays down or stalls: its one line, no traceback
        advice = "; the same command resumes from the last checkpoint" if isinstance(err, VLLMServerError) else ""
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(err))}{advice}", markup=True, highlight=False,
                                   soft_wrap=True)
        return 2
    except KeyboardInterrupt as interrupt:
        advice = (str(interrupt) if isinstance(interrupt, TrainingInterrupted) else
                  "interrupted: run the same command again to resume from the last checkpoint (one stopped before "
                  "its first save starts over)")
        Console(stderr=True).print(advice, markup=False, highlight=False, soft_wrap=True)
        return interrupt.exit_code if isinstance(interrupt, TrainingPreempted) else 130
    finally:
        _close_process_group(finished)


def _close_process_group(finished: bool = False) -> None:
    """Close a launch's process group before the command returns. Left to interpreter shutdown, gloo's worker
    threads can be destroyed while still joinable, which aborts a process that has finished its work ('terminate
    called without an active exception', exit -6). A finished run first collects garbage (objects that still hold
    the group or tensors in flight die while the interpreter is whole) and waits at a barrier, so that no process
    tears its connections down while another is still writing its outputs; a failed one skips the barrier, which
    would wait for a process that may never arrive. Only the entry point does this: a library call inside the
    user's own distributed script leaves their group alone."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if finished:
        gc.collect()
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
