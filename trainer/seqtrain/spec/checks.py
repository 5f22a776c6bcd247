"""Cross-field rules: combinations that are each valid alone but impossible together.

Each rule returns Problems naming the field to change and a value that would work.
"""

from __future__ import annotations

import glob
import os

from seqtrain.spec.datafiles import data_problems
from seqtrain.spec.elastic import divisors_hint, elastic_problems, size_problems
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.names import label_value_problem, qualified_name_problem
from seqtrain.spec.problems import Problem
from seqtrain.spec.resolve import paths_readable, resolved_model, vocab_conflict
from seqtrain.spec.template import template_problems


def _init_problems(job: SeqTrainJob, m) -> list[Problem]:  # noqa: ANN001 - the resolved ModelSpec
    """model.init: the weights must exist (where this process can look) and fit the explicit dims."""
    from seqtrain.spec.init_source import SHAPE_FIELDS, describe_init, init_refusal, tensor_hint
    from seqtrain.spec.model import ModelSpec

    init = job.spec.model.init
    if not init or ("://" in init and not init.startswith("hf://")) or not paths_readable():
        return []
    desc = describe_init(init)
    if desc is None:
        # A folder that does not exist yet is fine here (written by an export before the run, or present only in
        # the pods); the trainer fails clearly if it is still missing. One that exists must describe a model.
        if init.startswith("hf://") or os.path.isdir(os.path.expanduser(init)):
            refusal = init_refusal(init)  # a config.json seqtrain cannot represent: its own key, not "no description"
            return [Problem("spec.model.init", refusal or f"{init!r} holds no model description (seqtrain.json, "
                                               "config.json, meta.json or a run's trainer config); give an export, "
                                               "run, checkpoint or Hugging Face model folder")]
        return []
    out = []
    for field in SHAPE_FIELDS:
        want, have = desc.get(field), getattr(m, field)
        if want is not None and have != want:
            name = ModelSpec.model_fields[field].alias or field
            out.append(Problem(f"spec.model.{name}", f"{have} does not fit the weights in model.init {init!r} "
                                                     f"({name} {want}: {tensor_hint(field, desc)}); remove "
                                                     f"model.{name} or set it to {want}"))
    return out


def check(job: SeqTrainJob) -> list[Problem]:
    out: list[Problem] = []
    if job.spec.training.micro_batch_size == "auto":
        from seqtrain.spec.memory import auto_micro_batch, with_micro_batch

        if job.spec.optimization.pipeline_parallel > 1:
            return [Problem("spec.training.microBatchSize", "auto chooses the micro-batch of data parallelism; with "
                            "pipelineParallel > 1 the pipeline's micro-batches come from "
                            "optimization.pipelineMicroBatches: set microBatchSize to a number")]
        job = with_micro_batch(job, auto_micro_batch(job).size)  # every rule below checks the size auto picks
    s = job.spec
    res = s.resources
    opt = s.optimization
    tr = s.training

    if res.gpus > 0 and res.processes_per_replica is not None and res.processes_per_replica != res.gpus:
        out.append(Problem("spec.resources.processesPerReplica",
                           f"must equal resources.gpus ({res.gpus}) on GPUs: one rank per GPU"))

    if opt.tensor_parallel > res.procs:
        out.append(Problem("spec.optimization.tensorParallel",
                           f"tensor-parallel groups must fit inside one replica ({res.procs} processes); "
                           f"use at most {res.procs}"))

    m = resolved_model(job)

    out += size_problems(job, m)
    out += elastic_problems(job, m)
    if s.data.seq_len > (m.max_seq_len or 0):
        out.append(Problem("spec.data.seqLen",
                           f"{s.data.seq_len} is longer than the model accepts (model.maxSeqLen = {m.max_seq_len}); "
                           f"use at most {m.max_seq_len} or raise model.maxSeqLen"))
    if m.arch == "gpt":
        assert m.dim and m.heads and m.kv_heads
        if m.head_dim is None and m.dim % m.heads != 0:
            out.append(Problem("spec.model.heads", f"model.dim {m.dim} must be divisible by heads {m.heads}; "
                                                   f"divisors of {m.dim}: {divisors_hint(m.dim, 10)}"))
        elif m.head_size % 2 != 0 and m.positions == "rope":
            out.append(Problem("spec.model.heads", f"head dim {m.head_size} must be even for RoPE"))
        if m.heads % m.kv_heads != 0:
            out.append(Problem("spec.model.kvHeads", f"heads {m.heads} must be a multiple of kvHeads {m.kv_heads}"))
    else:
        for name in ("heads", "kv_heads", "ffn_dim"):
            if name in s.model.model_fields_set and getattr(s.model, name) is not None:
                alias = {"heads": "heads", "kv_heads": "kvHeads", "ffn_dim": "ffnDim"}[name]
                out.append(Problem(f"spec.model.{alias}", f"only applies to arch gpt, not {m.arch}; remove it"))
    conflict = vocab_conflict(job)  # weights and data disagree on the vocabulary: one message, not two
    out += [conflict] if conflict else []
    out += [p for p in _init_problems(job, m) if not (conflict and p.path == "spec.model.vocabSize")]
    from seqtrain.spec.model import layout_problems

    out += [Problem(path, msg) for path, msg in layout_problems(m, opt.tensor_parallel, opt.pipeline_parallel,
                                                                 opt.sequence_parallel)]
    if m.lora is not None:
        from seqtrain.layout.rules import engine_of
        from seqtrain.spec.lora import unknown_targets
        from seqtrain.spec.model import LORA_TARGETS

        bad = unknown_targets(m)
        if bad:
            out.append(Problem("spec.model.lora.targetModules", f"{', '.join(bad)} not in {m.arch}'s targets; use "
                                                                f"some of {', '.join(LORA_TARGETS[m.arch])}"))
        if engine_of(job) != "ddp" or opt.tensor_parallel > 1 or opt.pipeline_parallel > 1:
            out.append(Problem("spec.model.lora", "LoRA runs on the native data-parallel engine only (DDP or one "
                                                  "process): set optimization.engine native, zero.stage 0, "
                                                  "tensorParallel 1 and pipelineParallel 1"))
    from seqtrain.spec.init_tokenizer import data_tokenizer, tokenizer_problems

    tok_problems = tokenizer_problems(job, m)  # model.init's vocabulary: the one message that says what to do
    out += tok_problems
    tok_vocab = None
    if not tok_problems and data_tokenizer(job).type == "byte" and s.data.source not in ("synthetic", "tokens"):
        tok_vocab = 256  # token files hold ids already: their vocabulary is theirs (nanoGPT's shakespeare_char: 65)
    if tok_vocab and m.vocab_size and m.vocab_size < tok_vocab:
        out.append(Problem("spec.model.vocabSize", f"{m.vocab_size} is smaller than the tokenizer's {tok_vocab} ids"))

    d = s.data
    if d.max_tokens_per_batch is not None and d.max_tokens_per_batch < d.seq_len:
        out.append(Problem("spec.data.maxTokensPerBatch",
                           f"{d.max_tokens_per_batch} cannot hold one sequence of seqLen {d.seq_len}; "
                           f"use at least {d.seq_len}"))
    if d.source == "synthetic":
        syn = d.synthetic
        example = 2 * syn.length + 3 if syn.task == "copy" else 2 * (syn.length // 2) + 5
        if example > d.seq_len:
            out.append(Problem("spec.data.synthetic.length",
                               f"a {syn.task} example of length {syn.length} takes {example} tokens, more than "
                               f"seqLen {d.seq_len}; raise data.seqLen to {example} or shorten the task"))
        if syn.task == "recall" and syn.length // 2 > syn.vocab // 2:
            out.append(Problem("spec.data.synthetic.length",
                               f"recall needs distinct keys: {syn.length // 2} pairs do not fit in {syn.vocab // 2} "
                               f"key symbols; use length <= {syn.vocab // 2 * 2} or a larger synthetic.vocab"))
    if d.source in ("text", "jsonl", "tokens") and not d.paths:
        out.append(Problem("spec.data.paths", f"source {d.source} needs at least one file or glob"))
    if d.weights is not None:
        if d.source != "tokens":
            out.append(Problem("spec.data.weights", f"blending applies to source tokens, not {d.source}; remove it"))
        elif len(d.weights) != len(d.paths):
            out.append(Problem("spec.data.weights", f"{len(d.weights)} weights for {len(d.paths)} paths; give one "
                                                    "weight per entry of data.paths"))
        elif any(w <= 0 for w in d.weights):
            out.append(Problem("spec.data.weights", "every weight must be above 0 (drop a dataset from paths instead)"))
    if d.source == "tokens" and m.vocab_size is not None and paths_readable() and not conflict:
        from seqtrain.spec.resolve import _prepared_vocab

        need = _prepared_vocab(d.paths)
        if need is not None and m.vocab_size < need:
            out.append(Problem("spec.model.vocabSize", f"{m.vocab_size} is smaller than the prepared data's vocabulary "
                                                       f"{need} (end-of-document id included); use at least {need}"))
    if d.tokenizer.type == "file" and not d.tokenizer.path:
        out.append(Problem("spec.data.tokenizer.path", "type file needs the path of a tokenizer.json"))
    elif d.tokenizer.type == "file" and d.tokenizer.path and "://" not in d.tokenizer.path and paths_readable() \
            and not os.path.isfile(os.path.expanduser(d.tokenizer.path)):
        # checked where the job runs (seqtrain run / validate here, the trainer in its pod), never by the operator
        out.append(Problem("spec.data.tokenizer.path", f"{d.tokenizer.path!r} is not a file; give the path of a "
                                                       "tokenizer.json (or use tokenizer type byte)"))
    if d.source in ("text", "jsonl", "tokens") and d.paths and paths_readable():
        missing = [p for p in d.paths if "://" not in p and not glob.glob(os.path.expanduser(p))]
        for p in missing:
            out.append(Problem("spec.data.paths", f"{p!r} matches no file"))
    out += data_problems(job, paths_readable(), m.vocab_size)

    ev = tr.eval
    if ev.every > 0 and ev.batches == 0:
        out.append(Problem("spec.training.eval.batches", "eval.every is set, so batches must be at least 1"))
    if ev.early_stopping is not None and (ev.batches == 0 or ev.every == 0):
        out.append(Problem("spec.training.eval.earlyStopping", "needs eval.every and eval.batches above 0"))
    if tr.profile is not None and tr.profile.start_step > tr.steps:
        out.append(Problem("spec.training.profile.startStep",
                           f"{tr.profile.start_step} is after the last step ({tr.steps}); use at most {tr.steps}"))
    if tr.schedule.warmup_steps > tr.steps:
        out.append(Problem("spec.training.schedule.warmupSteps",
                           f"{tr.schedule.warmup_steps} is more than training.steps ({tr.steps})"))
    if s.checkpoint.path and "://" in s.checkpoint.path:
        # torch.save, DCP and DeepSpeed write local files: a URI would be a folder literally named "s3:"
        out.append(Problem("spec.checkpoint.path", f"{s.checkpoint.path!r}: remote URIs are not supported; use a "
                           "folder on storage every rank shares (checkpoint.pvc, or a mounted shared filesystem)"))
    if s.optimization.zero.offload == "cpu" and tr.optimizer.name != "adamw":
        # DeepSpeed updates offloaded states with its CPU Adam: another rule would be silently replaced
        out.append(Problem("spec.training.optimizer.name", f"{tr.optimizer.name} cannot run with "
                           "optimization.zero.offload: cpu (offloaded states are updated by DeepSpeed's CPU AdamW); "
                           "use name: adamw, or set optimization.zero.offload: none"))
    if s.scheduling.topology.policy != "none" and not s.scheduling.topology.keys:
        out.append(Problem("spec.scheduling.topology.keys", f"policy {s.scheduling.topology.policy} needs at least one label key"))
    out += [Problem(f"spec.podTemplate.{path}", msg) for path, msg in template_problems(s.pod_template)]
    for key, value in s.scheduling.node_selector.items():  # pod fields: the API server would refuse the pod
        if why := qualified_name_problem(key) or label_value_problem(value):
            out.append(Problem(f"spec.scheduling.nodeSelector.{key}", f"not a valid node label: {why}"))
    for i, key in enumerate(s.scheduling.topology.keys):
        if why := qualified_name_problem(key):
            out.append(Problem(f"spec.scheduling.topology.keys[{i}]", f"not a valid node label key: {why}"))
    sched = s.scheduling
    if sched.gang == "kueue" and not sched.queue:
        out.append(Problem("spec.scheduling.queue", "gang kueue needs the name of a Kueue LocalQueue in the job's "
                           "namespace"))
    if sched.gang == "kai" and "topology" in sched.model_fields_set and sched.topology.policy in ("require", "pack") \
            and not sched.topology.name:
        out.append(Problem("spec.scheduling.topology.name", "gang kai places a gang by a named Topology object: set "
                                                            "it (kubectl get topologies.kueue.x-k8s.io), or policy none"))
    if sched.gang == "coscheduling" and sched.queue:
        out.append(Problem("spec.scheduling.queue", "coscheduling has no queues (its PodGroup has no queue field); "
                           "remove it, or use gang kueue, volcano or kai"))
    return out
