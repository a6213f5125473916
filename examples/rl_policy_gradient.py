"""One policy-gradient step on rollouts sampled with corelib, on a tiny model built here.

    python examples/rl_policy_gradient.py [--backend NAME] [--steps N] [--seed S]

1. Rollout: ``corelib.integrations.hf.generate`` samples G completions per prompt with
   temperature, top-k, top-p and min-p, and returns each step's kept set (the tokens the
   completion could have drawn), the drawn token's processed logprob and the logits it sampled
   from (``return_kept=True, return_logits=True, logprobs_mode="processed"``).
2. Trainer: one full-sequence forward pass of the same model over prompt + completion
   (teacher forcing), then ``sampler.score(trainer_logits, batch, tokens, kept=rollout.kept)``
   on a fresh batch holding the same requests: the rollout's distribution (same temperature,
   same kept set) on the trainer's logits, differentiable.
3. A GRPO-style loss (group-normalised advantages of a toy reward, a clipped importance
   ratio, a token mean over the completions' real tokens) and ``backward()``.

It prints, and ``run()`` returns:

- ``trainer_vs_rollout``: max |trainer's processed logprob - rollout's| over the drawn
  tokens. The two forward passes (incremental with a KV cache, full sequence) differ in
  float32 rounding only.
- ``rollout_logits_vs_rollout``: the same with the trainer handed the rollout's own logits:
  0.0, bitwise (one backend, the same values in, the same pipeline).
- ``trainer_without_kept_vs_rollout``: the trainer's logits scored without ``kept=``, the
  truncation recomputed from them (it has no random part here; a token near a cut-off could
  fall on the other side, which ``kept=`` rules out).
- ``reference_backend_vs_rollout``: the rollout's logits scored by the reference backend
  (0.0 when it is the rollout's backend; another backend's arithmetic may differ in rounding).
- ``float64_vs_rollout``: the rollout's logits in float64, requiring grad (scored in float64).
- ``mean_log_kept_mass``: the mean, over the drawn tokens, of log S, S the kept set's mass
  under the tempered distribution softmax(logits / T) (= the tempered full-vocabulary
  log_softmax of the token minus its processed logprob): what a trainer taking log_softmax
  over the whole vocabulary would be off by, per token.
- ``mean_log_kept_mass_untempered``: the same gap for a trainer that also forgets the
  temperature (plain log_softmax of the logits minus the processed logprob); not a log S.
- ``loss``, ``grad_norm``: the loss and the gradient norm over the model's parameters.
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

import torch

import corelib
from corelib import SamplingParams
from corelib.integrations import hf

VOCAB = 128
PAD = 0
EOS = 2
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20, 21, 22, 23]]
GROUP = 4          # completions per prompt (GRPO's group)
TEMPERATURE = 0.8
CLIP = 0.2         # PPO/GRPO ratio clipping


def tiny_model(seed: int = 0):
    """A 2-layer Llama of V = 128 with random weights; its output layer is scaled so that its
    logits spread as a trained model's (a few units), which makes each filter drop tokens."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def rollout_params(seed: int) -> list[SamplingParams]:
    """One request per prompt, G children each, seeded so that the printed numbers reproduce
    (unseeded rows carry their kept sets to the trainer alike)."""
    return [SamplingParams(n=GROUP, temperature=TEMPERATURE, top_k=40, top_p=0.9, min_p=0.05,
                           seed=seed + i) for i in range(len(PROMPTS))]


def new_batch(sampler, params: list[SamplingParams]):
    """A batch holding the rollout's requests afresh (same prompts, same params)."""
    batch = sampler.new_batch(VOCAB, eos_token_id=EOS, logprobs_mode="processed")
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        batch.add(str(i), p, prompt_token_ids=prompt)
    return batch


def trainer_forward(model, rollout) -> torch.Tensor:
    """float32 [C, S, V], with grad: the logits that predict each completion token, from one
    forward pass over prompt (left-padded) + completion (right-padded)."""
    prompt_len = rollout.prompt_ids.shape[1]
    ids = rollout.completion_ids()                                          # [C, S], -1 after the end
    sequences = rollout.sequences(PAD)                                      # [C, prompt_len + S]
    prompt_mask = (torch.arange(prompt_len)[None, :]
                   >= prompt_len - torch.tensor([len(PROMPTS[c.prompt_index]) for c in rollout.rows])[:, None])
    mask = torch.cat([prompt_mask, ids >= 0], dim=1).long()
    # positions as generate numbers them: counted over the prompt's real tokens
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
    # position p's logits predict token p + 1: the completion's S tokens from prompt_len - 1 on
    return logits[:, prompt_len - 1: prompt_len - 1 + ids.shape[1]].float()


def toy_reward(tokens: list[int]) -> float:
    """The share of even token ids (a stand-in for a verifier)."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, rewards: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """logprobs (with grad), old_logprobs float32 [C, S]; rewards float32 [C] in groups of
    GROUP; mask bool [C, S] (the real tokens). The clipped surrogate, token-mean."""
    groups = rewards.view(-1, GROUP)
    advantages = ((groups - groups.mean(dim=1, keepdim=True))
                  / (groups.std(dim=1, keepdim=True) + 1e-6)).flatten()[:, None]   # [C, 1]
    # padding reads 0 in both: the ratio is 1 there, and the mask drops it from the mean
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    return -(surrogate * mask).sum() / mask.sum()


def run(backend: Optional[str] = None, steps: int = 16, seed: int = 1000) -> dict[str, float]:
    model = tiny_model()
    sampler = corelib.get_sampler(backend)
    params = rollout_params(seed)

    # 1. the rollout (an inference engine's job; here corelib's loop over the model's cache)
    rollout = hf.generate(model, PROMPTS, params, max_new_tokens=steps, eos_token_id=EOS,
                          sampler=sampler, logprobs_mode="processed",
                          return_kept=True, return_logits=True)
    ids = rollout.completion_ids()                                          # [C, S]
    mask = ids >= 0

    # 2. the trainer: its own forward pass, scored under the rollout's kept sets
    trainer_logits = trainer_forward(model, rollout)
    scored = sampler.score(trainer_logits, new_batch(sampler, params), ids, kept=rollout.kept)
    with torch.no_grad():
        own = sampler.score(rollout.logits, new_batch(sampler, params), ids, kept=rollout.kept)
        # no kept=: score recomputes the truncation on the trainer's logits (deterministic
        # here: top-k, top-p and min-p have no random part)
        recomputed = sampler.score(trainer_logits.detach(), new_batch(sampler, params), ids)
        reference = corelib.get_sampler("reference")
        on_reference = reference.score(rollout.logits, new_batch(reference, params), ids, kept=rollout.kept)
    # float64 logits that require grad are scored in float64 (the gradcheck path)
    in_float64 = sampler.score(rollout.logits.double().requires_grad_(True), new_batch(sampler, params),
                               ids, kept=rollout.kept).logprobs.detach()
    with torch.no_grad():
        tempered = torch.log_softmax(rollout.logits / TEMPERATURE, dim=-1)
        untempered = torch.log_softmax(rollout.logits, dim=-1)
        token = ids.clamp(min=0)[..., None]
        log_kept_mass = (tempered.gather(-1, token)[..., 0] - rollout.logprobs)[mask]
        untempered_gap = (untempered.gather(-1, token)[..., 0] - rollout.logprobs)[mask]

    # 3. the loss
    rewards = torch.tensor([toy_reward(c.token_ids) for c in rollout.rows])
    loss = grpo_loss(scored.logprobs, rollout.logprobs, rewards, mask)
    model.zero_grad()
    loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return {
        "completions": float(ids.shape[0]),
        "tokens": float(mask.sum()),
        "stopped_early": float(sum(c.finish_reason == "stop" for c in rollout.rows)),
        "mean_kept_tokens": float(corelib.bitmask.unpack_bitmask(
            rollout.kept[mask], VOCAB).sum(dim=-1).float().mean()),
        "trainer_vs_rollout": float((scored.logprobs.detach() - rollout.logprobs)[mask].abs().max()),
        "rollout_logits_vs_rollout": float((own.logprobs - rollout.logprobs)[mask].abs().max()),
        "trainer_without_kept_vs_rollout": float(
            (recomputed.logprobs - rollout.logprobs)[mask].abs().max()),
        "reference_backend_vs_rollout": float((on_reference.logprobs - rollout.logprobs)[mask].abs().max()),
        "float64_vs_rollout": float((in_float64 - rollout.logprobs.double())[mask].abs().max()),
        "all_kept": float(bool(scored.kept_token[mask].all())),
        "mean_log_kept_mass": float(log_kept_mass.mean()),
        "min_log_kept_mass": float(log_kept_mass.min()),
        "mean_log_kept_mass_untempered": float(untempered_gap.mean()),
        "loss": float(loss.detach()),
        "grad_norm": float(torch.cat(grads).norm()) if grads else math.nan,
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None,
                        help="corelib backend (default: corelib.get_sampler()'s choice)")
    parser.add_argument("--steps", type=int, default=16, help="max new tokens per completion")
    parser.add_argument("--seed", type=int, default=1000, help="first seed of the seeded prompts")
    args = parser.parse_args(argv)
    results = run(args.backend, args.steps, args.seed)
    for name, value in results.items():
        print(f"{name}: {value:.9g}")


if __name__ == "__main__":
    main()
