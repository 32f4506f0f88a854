"""strata.optim.AdamW under Hugging Face's Trainer, as a user hands it in
(`Trainer(optimizers=(opt, None))`), against torch.optim.AdamW on a tiny
randomly initialised causal LM (nothing is downloaded): the same losses,
and a checkpoint saved mid-run from which training resumes to the same end.

Skipped, with the reason printed, where torch or transformers is not
installed; with STRATA_REQUIRE_TORCH=1 (CI) a missing one is a failure."""

import os

import pytest

if os.environ.get("STRATA_REQUIRE_TORCH") == "1":
    import accelerate  # noqa: F401  (must be there)
    import torch
    import transformers  # noqa: F401
else:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (tests/run.sh installs it unless STRATA_NO_TORCH=1)"
    )
    pytest.importorskip(
        "transformers",
        reason="transformers is not installed (tests/run.sh installs it unless STRATA_NO_TORCH=1)",
    )

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import strata.optim

STEPS, SAVE_AT = 12, 6


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    """Counting sequences from random starts, which a model learns fast
    (labels = inputs: the model shifts them)."""

    def __init__(self, n=64, length=16, seed=1):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 96, (n, 1), generator=g)
        self.ids = (start + torch.arange(length)) % 96

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def train(tmp_path, name, make_opt, resume=False, max_steps=STEPS):
    model = tiny_lm()
    args = TrainingArguments(
        output_dir=str(tmp_path / name),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_steps=SAVE_AT,
        save_strategy="steps",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    opt = make_opt(model)
    losses = Losses()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        optimizers=(opt, None),
        callbacks=[losses],
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / name / f"checkpoint-{SAVE_AT}") if resume else None)
    return losses.losses, [p.detach().clone() for p in model.parameters()]


def torch_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)


def strata_adamw(model):
    return strata.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)


def test_trainer_fine_tunes_with_strata_as_with_torch_and_resumes(tmp_path):
    ref, ref_params = train(tmp_path, "torch", torch_adamw)
    got, got_params = train(tmp_path, "strata", strata_adamw)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert abs(got[step] - ref[step]) <= 1e-3 * abs(ref[step]), (step, got[step], ref[step])
    assert ref[STEPS] < ref[1], "the model trains"
    for p, q in zip(got_params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)
    # The checkpoint Trainer saved at SAVE_AT holds strata's optimizer state
    # (torch's format); a run resumed from it ends where the whole run did.
    ckpt = tmp_path / "strata" / f"checkpoint-{SAVE_AT}"
    assert (ckpt / "optimizer.pt").exists()
    resumed, resumed_params = train(tmp_path, "strata", strata_adamw, resume=True)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step in resumed:
        assert abs(resumed[step] - got[step]) <= 1e-5 * abs(got[step]), (step, resumed[step], got[step])
    for p, q in zip(resumed_params, got_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
