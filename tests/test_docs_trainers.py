"""The docs' trainer examples, run as written against the real pytorch-lightning and
transformers of the venv ``make setup`` creates (no stand-in for any library; a tiny
model built here, nothing downloaded): Lightning's ``FmstoreCheckpointIO`` block of
docs/integrations.md, and the ``ckpt convert`` + ``from_pretrained`` lines of
docs/checkpoint.md.  Each runs in a fresh interpreter, as a user's script would."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
REPO = str(DOCS.parent)


def blocks(doc: str, lang: str) -> list[str]:
    """The fenced code blocks of ``doc`` opened with ```` ```lang ````."""
    out: list[str] = []
    opened: str | None = None
    body: list[str] = []
    for line in (DOCS / doc).read_text().splitlines():
        if opened is None and line.startswith("```"):
            opened, body = line[3:].strip(), []
        elif opened is not None and line.strip() == "```":
            if opened == lang:
                out.append("\n".join(body) + "\n")
            opened = None
        elif opened is not None:
            body.append(line)
    return out


def run(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def environment(tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
    )
    bin_dir = os.path.dirname(sys.executable)
    return {
        **os.environ,
        "PYTHONPATH": REPO,
        "FMSTORE_CONFIG": str(cfg),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


LIGHTNING_SETUP = """
import torch
import pytorch_lightning as pl

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(0)
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)),
    batch_size=8,
)
model = Tiny()
"""


def test_the_lightning_example_runs_as_written(tmp_path):
    pytest.importorskip("pytorch_lightning")
    (example,) = [b for b in blocks("integrations.md", "python") if "FmstoreCheckpointIO()" in b]
    # The paths it names, put under the test's directory; nothing else changes.
    example = example.replace("/nvme/runs/a", str(tmp_path / "nvme" / "runs" / "a"))
    env = environment(tmp_path)
    # Trainer defaults from the environment (Lightning's PL_TRAINER_*): one short epoch.
    env.update(
        PL_TRAINER_MAX_EPOCHS="1",
        PL_TRAINER_LOGGER="0",
        PL_TRAINER_ENABLE_PROGRESS_BAR="0",
        PL_TRAINER_ENABLE_MODEL_SUMMARY="0",
        PL_TRAINER_ACCELERATOR="cpu",
    )
    r = run(LIGHTNING_SETUP + example, tmp_path, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torchvision" not in r.stderr
    # What the script left, read by another process once it has exited.
    check = textwrap.dedent(
        """
        import fmstore
        last = fmstore.load("nvme:runs/a/last.ckpt")
        manual = fmstore.load("nvme:runs/a/manual.ckpt")
        assert set(last["state_dict"]) == {"layer.weight", "layer.bias"}, last.keys()
        assert manual["global_step"] == last["global_step"] == 2
        print("ok")
        """
    )
    r = run(check, tmp_path, env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_the_from_pretrained_example_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    (block,) = [b for b in blocks("checkpoint.md", "") if "from_pretrained('export/gpt')" in b]
    assert block.startswith("fmstore ckpt convert"), block
    env = environment(tmp_path)
    # What the example starts from: a training checkpoint whose "model" is a (tiny) GPT-2,
    # and that model's config.json.
    make = textwrap.dedent(
        """
        import fmstore, transformers
        cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
        model = transformers.GPT2LMHeadModel(cfg)
        fmstore.save({"model": model.state_dict(), "step": 1000}, "runs/gpt/step-1000")
        cfg.to_json_file("config.json")
        """
    )
    r = run(make, tmp_path, env)
    assert r.returncode == 0, r.stderr
    # The block, with a check that the loaded weights are the saved ones.
    script = block.replace(
        "M.from_pretrained('export/gpt')",
        "import fmstore, torch; m = M.from_pretrained('export/gpt'); "
        "s = fmstore.load('runs/gpt/step-1000')['model']; "
        "assert all(torch.equal(t, s[k]) for k, t in m.state_dict().items()); print('ok')",
    )
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


HF_SETUP = """
import torch
import transformers

torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
model = transformers.GPT2LMHeadModel(cfg)
ids = torch.randint(0, 50, (16, 16), generator=torch.Generator().manual_seed(0))
ds = [{"input_ids": r, "labels": r} for r in ids]
args = transformers.TrainingArguments(
    output_dir="out", max_steps=4, save_steps=2, per_device_train_batch_size=4,
    report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no",
)
"""


def test_the_hf_callback_example_runs_as_written(tmp_path):
    """The ``FmstoreCallback`` block of docs/integrations.md, run twice: the second run
    continues from the first's newest step (nothing left to train) instead of starting over."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    (example,) = [
        b
        for b in blocks("integrations.md", "python")
        if "trainer.train()      # saves at save_steps" in b
    ]
    env = environment(tmp_path)
    report = (
        "\nimport fmstore\nm = fmstore.CheckpointManager('runs/gpt', run_policies=False)\n"
        "print('steps', m.steps(), 'global_step', trainer.state.global_step)\n"
    )
    for expected in ("steps [2, 4] global_step 4", "steps [2, 4] global_step 4"):
        r = run(HF_SETUP + example + report, tmp_path, env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip().splitlines()[-1] == expected, r.stdout + r.stderr
    # replace_trainer_save=True: the Trainer wrote no checkpoint of its own format.
    assert not list((tmp_path / "out").glob("checkpoint-*"))
