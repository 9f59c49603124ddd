"""Monarch actors, each a thin shell over a pluggable backend named in ``registry.py`` (backend name -> import
path). The rooms below import only rooms listed under them, and no package's ``__init__`` imports torch, so a
topology check (``mesh``) reads any room's config without loading a backend:

    trainer/          the Trainer actor: steps an inner loop on each batch, publishes the weights it makes
    diloco/           DiLoCo across RL replicas: the trainer's outer loop, its config and its transports
    reference_model/  the KL reference model, on the trainer's ranks or a mesh of its own
    inner_loops/      one optimizer step over a TrainBatch (native, trl, prime_rl, torchtitan) and checkpoints
    generator/        the Generator actor, its config and its engines (hf, vllm)
    rewarder/         the Rewarder actor and the reward functions the generator runs too
    teachers/         the TeacherPool actor, its config and the teacher bindings
    environments/     multi-turn episodes and external tasksets (OpenEnv, verifiers), behind text-only interfaces
    agents/           agent code for the OpenAI API as guests: the endpoint, the agent host, the stitcher
    sandbox/          the python tool's sandbox: model-written code gets compute and a scratch directory only
    weights/          versioned, checksummed weight sync from the trainer to its followers, by transport
    contract/         the rollout data contract: rollouts, a teacher's top-k, the trainer's batch
    models/           where a model comes from and what it is: its source, facts, tokenizers, LoRA, GGUF
    tasks/            where prompts come from and how a completion is rewarded (text only)
    basics/           torch-free basics shared with mesh: files on disk, URLs, shares, compute, processes
"""
