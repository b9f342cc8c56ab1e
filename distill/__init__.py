"""`specmesh distill`: train a small draft model for a target by self-distillation.

prompts   -> the training / held-out prompts (templates x topics + text shipped on this machine)
generate  -> the target's own generations for them, with its top-k logits (resumable shards)
vocab     -> the draft's reduced vocabulary (FR-Spec: most frequent target outputs)
train     -> the distillation loop (checkpoints, resumes)
evaluate  -> offline acceptance on held-out prompts (committed tokens per step)
run       -> the command: arguments, the phases above, the output folder
"""
