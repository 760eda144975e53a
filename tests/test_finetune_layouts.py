"""Published layouts read by the mapping in a finetune render's model.py (`from_published`): Hugging
Face GPT-2's safetensors into the generation GPT at --arch gpt2, torchvision's ResNet-18 names and
shapes into the image ResNet at --arch resnet18; and `prepare` with GPT-2's tokenizer.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_project import _env, render, run


@pytest.fixture(scope="module")
def generation(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("layouts") / "gen", task="generation", finetune=True)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("layouts") / "img", task="image", finetune=True)


def python(project: Path, code: str) -> dict:
    """Runs `code` in the project's environment ({pkg}: its package); its last line's JSON."""
    package = next((project / "src").iterdir()).name
    done = subprocess.run(
        [sys.executable, "-c", code.replace("{pkg}", package)],
        cwd=project,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# transformers' GPT-2 at a small config, every weight random (biases and norms too, so a
# misplaced or untransposed tensor shows), saved as Hugging Face saves it: model.safetensors,
# "transformer."-prefixed, the tied lm_head left out. The hub's gpt2 file is GPT2Model's: no
# prefix, causal-mask buffers included; both are read.
GPT2_LOGITS = """
import json, torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel
from {pkg} import model as m
from {pkg}.config import Config

torch.manual_seed(0)
hf_cfg = GPT2Config(vocab_size=301, n_positions=32, n_embd=64, n_layer=3, n_head=4)
hf_cfg._attn_implementation = "eager"
ref = GPT2LMHeadModel(hf_cfg).eval()
with torch.no_grad():
    for p in ref.parameters():
        p.add_(torch.randn_like(p) * 0.1)
ref.save_pretrained("gpt2-small")
bare = {k.removeprefix("transformer."): v for k, v in ref.state_dict().items()}
del bare["lm_head.weight"]
for i in range(hf_cfg.n_layer):  # the hub file's buffers
    bare[f"h.{i}.attn.bias"] = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
    bare[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
save_file({k: v.contiguous() for k, v in bare.items()}, "hub-layout.safetensors")

cfg = Config(arch="gpt2", block_size=32, n_layer=3, n_head=4, n_embd=64, dropout=0.0)
tokenizer = type("Tok", (), {"vocab_size": 301})()
idx = torch.randint(0, 301, (3, 32))
with torch.no_grad():
    want = ref(idx).logits
diffs, keys = [], []
for path in ("gpt2-small/model.safetensors", "hub-layout.safetensors"):
    ours = m.build_model(cfg, type("Splits", (), {"tokenizer": tokenizer})()).eval()
    state = m.from_published(load_file(path))
    missing, unexpected = ours.load_state_dict(state, strict=True)
    keys.append(sorted(state) == sorted(ours.state_dict()))
    with torch.no_grad():
        diffs.append((ours(idx) - want).abs().max().item())
own = ours.state_dict()
tied = ours.lm_head.weight is ours.wte.weight
scale = want.abs().max().item()
unchanged = m.from_published(own) is own
got = {"diffs": diffs, "keys": keys, "own_unchanged": unchanged, "scale": scale, "tied": tied}
print(json.dumps(got))
"""


def test_gpt2_safetensors_give_transformers_logits(generation):
    """The same random GPT-2 weights give the same logits here as in transformers'
    GPT2LMHeadModel (fp32, within 1e-4), from its save_pretrained file and from the hub's layout;
    every key of the model is loaded (strict), and this model's own layout passes unchanged."""
    pytest.importorskip("transformers")
    got = python(generation, GPT2_LOGITS)
    assert got["keys"] == [True, True]  # exactly this model's keys: nothing missing, nothing extra
    assert max(got["diffs"]) < 1e-4, got
    assert got["scale"] > 1  # logits of a size that a wrong tensor would move
    assert got["own_unchanged"] and got["tied"]


# torchvision's resnet18(): every parameter and buffer in state_dict order with its shape, written
# out from torchvision/models/resnet.py (BasicBlock, layers [2, 2, 2, 2], 1000 classes).
def torchvision_resnet18_shapes() -> dict[str, tuple[int, ...]]:
    def bn(name: str, c: int) -> dict[str, tuple[int, ...]]:
        return {
            f"{name}.weight": (c,),
            f"{name}.bias": (c,),
            f"{name}.running_mean": (c,),
            f"{name}.running_var": (c,),
            f"{name}.num_batches_tracked": (),
        }

    shapes = {"conv1.weight": (64, 3, 7, 7), **bn("bn1", 64)}
    c_in = 64
    for stage, c_out in enumerate((64, 128, 256, 512), start=1):
        for b in range(2):
            block = f"layer{stage}.{b}"
            shapes[f"{block}.conv1.weight"] = (c_out, c_in if b == 0 else c_out, 3, 3)
            shapes |= bn(f"{block}.bn1", c_out)
            shapes[f"{block}.conv2.weight"] = (c_out, c_out, 3, 3)
            shapes |= bn(f"{block}.bn2", c_out)
            if b == 0 and stage > 1:
                shapes[f"{block}.downsample.0.weight"] = (c_out, c_in, 1, 1)
                shapes |= bn(f"{block}.downsample.1", c_out)
        c_in = c_out
    return shapes | {"fc.weight": (1000, 512), "fc.bias": (1000,)}


# torchvision's ResNet-18 forward, written from torchvision/models/resnet.py in torch.nn.functional,
# over the torchvision-named weights (eval: BatchNorm on running statistics); the input normalised
# with ImageNet's statistics, as torchvision's weights expect.
RESNET_FORWARD = """
import json, torch
import torch.nn.functional as F
from {pkg} import model as m
from {pkg}.config import Config

shapes = {shapes}
torch.manual_seed(0)
tv = {}
for name, shape in shapes.items():
    if name.endswith("num_batches_tracked"):
        tv[name] = torch.tensor(7)
    elif name.endswith("running_var"):
        tv[name] = torch.rand(shape) + 0.5
    else:
        tv[name] = torch.randn(shape) * (0.1 if len(shape) > 1 else 0.5)

def bn(x, p):
    stats = tv[p + ".running_mean"], tv[p + ".running_var"]
    return F.batch_norm(x, *stats, tv[p + ".weight"], tv[p + ".bias"])

def reference(x):
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    x = (x - mean) / std
    x = F.relu(bn(F.conv2d(x, tv["conv1.weight"], stride=2, padding=3), "bn1"))
    x = F.max_pool2d(x, 3, stride=2, padding=1)
    for stage in range(1, 5):
        for b in range(2):
            p, stride = f"layer{stage}.{b}", 2 if stage > 1 and b == 0 else 1
            out = F.conv2d(x, tv[p + ".conv1.weight"], stride=stride, padding=1)
            out = F.conv2d(F.relu(bn(out, p + ".bn1")), tv[p + ".conv2.weight"], padding=1)
            out = bn(out, p + ".bn2")
            if p + ".downsample.0.weight" in tv:
                shortcut = F.conv2d(x, tv[p + ".downsample.0.weight"], stride=stride)
                x = bn(shortcut, p + ".downsample.1")
            x = F.relu(out + x)
    x = F.adaptive_avg_pool2d(x, 1).flatten(1)
    return F.linear(x, tv["fc.weight"], tv["fc.bias"])

cfg = Config(arch="resnet18", width=64, blocks=2)
classes = [str(i) for i in range(1000)]
splits = type("Splits", (), {"classes": classes, "mean": [0.5] * 3, "std": [0.25] * 3})()
ours = m.build_model(cfg, splits).eval()
state = m.from_published(dict(tv))
ours.load_state_dict(state, strict=True)
own = ours.state_dict()
x = torch.rand(2, 3, 64, 64)
with torch.no_grad():
    want, got = reference(x), ours(x)
print(json.dumps({
    "keys": sorted(state) == sorted(own),
    "shapes": all(state[k].shape == own[k].shape for k in own),
    "diff": (got - want).abs().max().item(),
    "scale": want.abs().max().item(),
    "own_unchanged": m.from_published(own) is own,
    "head": list(m.HEAD),
}))
"""


def test_resnet18_names_and_shapes_give_the_reference_forward(image):
    """torchvision does not import with this CPU torch, so its ResNet-18 is written into the test:
    its state_dict's names and shapes (from torchvision's architecture) and its forward in
    torch.nn.functional. What passes: every torchvision name maps onto exactly this model's keys
    with the same shapes (a strict load), and random weights under those names give the
    reference forward's logits (fp32, within 1e-4): the stem, the stage order, the downsample
    shortcuts, the classifier and the ImageNet normalisation all land where torchvision has them.
    What it cannot prove: that the table and forward match torchvision's own code exactly."""
    shapes = torchvision_resnet18_shapes()
    assert len(shapes) == 122  # resnet18().state_dict() has 122 entries (62 parameters, 60 buffers)
    got = python(image, RESNET_FORWARD.replace("{shapes}", repr(shapes)))
    assert got["keys"] and got["shapes"]
    assert got["diff"] < 1e-4 and got["scale"] > 1, got
    assert got["own_unchanged"] and got["head"] == ["head"]


def test_arch_presets_give_published_settings_and_options_given_win(generation, image):
    """--arch fills in a published model's settings, an option given wins over its preset, and an
    unknown --arch is one line with exit 2 (the command line's main, in the same process)."""
    code = """
import contextlib, io, json
from {pkg}.__main__ import build_parser, main
from {pkg}.config import config_from_args
def cfg(*argv):
    return vars(config_from_args(build_parser().parse_args(["train", *argv])))
with contextlib.redirect_stderr(io.StringIO()) as err:
    status = main(["train", "--arch", "gpt3"])
got = [cfg(), cfg("--arch", "ARCH"), cfg("--arch", "ARCH", "--KEY", "2"), status, err.getvalue()]
print(json.dumps(got))
"""
    for project, arch, key, preset in (
        (generation, "gpt2", "n-layer", {"n_layer": 12, "n_head": 12, "n_embd": 768}),
        (image, "resnet18", "blocks", {"width": 64, "blocks": 2}),
    ):
        got = python(project, code.replace("ARCH", arch).replace("KEY", key))
        default, published, given, status, said = got
        assert {k: published[k] for k in preset} == preset
        assert all(default[k] != v for k, v in preset.items())
        assert given[key.replace("-", "_")] == 2 and given["arch"] == arch
        refused = f"error: arch must be {default['arch']} or {arch}, got 'gpt3'"
        assert status == 2 and said.strip().splitlines() == [refused]


def gpt2_like_tokenizer(path: Path, text: str) -> Path:
    """A tokenizer.json of GPT-2's form (a byte-level BPE, <|endoftext|> its last id), learnt from
    `text`: GPT-2's own file is a download away, and `prepare` reads any of this form alike."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet)
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


def test_prepare_takes_a_hugging_face_tokenizer_json_and_gpt2_settings_train_on_it(generation):
    package = next((generation / "src").iterdir()).name
    code = f"from {package}.data import synthetic_text; print(synthetic_text(300), end='')"
    done = subprocess.run([sys.executable, "-c", code], env=_env(generation), capture_output=True)
    (generation / "corpus.txt").write_bytes(done.stdout)
    tokenizer = gpt2_like_tokenizer(generation / "gpt2-tokenizer.json", done.stdout.decode())
    done = run(
        generation, "prepare", "--data", "corpus.txt", "--tokenizer", tokenizer, "--out", "c"
    )
    assert done.returncode == 0, done.stderr
    meta = json.loads((generation / "c/meta.json").read_text())
    given = json.loads(tokenizer.read_text())
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == len(given["model"]["vocab"]) + 1
    kept = json.loads((generation / "c/tokenizer.json").read_text())
    assert kept["model"]["vocab"] == given["model"]["vocab"]  # its ids, no merges learnt here
    assert kept["model"]["merges"] == given["model"]["merges"]

    # transformers' GPT-2 of this vocabulary, saved as Hugging Face saves it: every tensor loads
    code = """
from transformers import GPT2Config, GPT2LMHeadModel
config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2)
GPT2LMHeadModel(config).save_pretrained("hf-gpt2")
"""
    code = code.replace("VOCAB", str(meta["vocab_size"]))
    saved = subprocess.run([sys.executable, "-c", code], cwd=generation, capture_output=True)
    assert saved.returncode == 0, saved.stderr
    small = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16"]
    small += ["--max-steps", "3", "--batch-size", "4", "--eval-every", "3", "--run-dir", "runs/g"]
    source = "hf-gpt2/model.safetensors"
    done = run(generation, "train", "--data", "c", "--arch", "gpt2", *small, "--init-from", source)
    assert done.returncode == 0, done.stderr
    said = [line for line in (done.stdout + done.stderr).splitlines() if "weights:" in line]
    assert len(said) == 1 and f"weights: 17 tensors from {source}" in said[0], said  # all
    record = json.loads((generation / "runs/g/run.json").read_text())["init_from"]
    assert record["source"] == source and record["reinitialised"] == []


def test_torchvision_resnet18_weights_load_with_the_classifier_re_initialised(image):
    """A torchvision-named ResNet-18 file (1,000 classes) read by --init-from's loader into the
    model at --arch resnet18 (4 classes): all but the classifier loads; the classifier, of another
    number of classes, is re-initialised and said (the loader's own path, without training: a
    ResNet-18 run's checkpoints take most of a minute to write here)."""
    shapes = torchvision_resnet18_shapes()
    code = f"""import json, torch
from {{pkg}}.config import Config
from {{pkg}}.model import build_model
from {{pkg}}.runtime.weights import prepare
tensors = {{k: torch.zeros(s, dtype=torch.long if not s else None) for k, s in {shapes!r}.items()}}
torch.save(tensors, "r18.pth")
splits = type("Splits", (), {{"classes": list("abcd"), "mean": [0.5] * 3, "std": [0.25] * 3}})()
model = build_model(Config(arch="resnet18", width=64, blocks=2), splits)
state, record, lines = prepare("r18.pth", model.state_dict())
print(json.dumps({{"lines": lines, "reinitialised": record["reinitialised"], "n": len(state)}}))
"""
    got = python(image, code)
    assert got["n"] == len(shapes) - 2 + 2  # the classifier left out, ImageNet's mean and std in
    assert got["lines"][0].startswith(f"weights: {got['n']} tensors from r18.pth")
    assert "re-initialised, not loaded (model.HEAD): head.weight" in got["lines"][1]
    assert got["reinitialised"] == ["head.weight", "head.bias"]


def test_a_tokenizer_json_that_cannot_serve_is_refused_in_one_line(generation, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    wordpiece = tokenizers.Tokenizer(tokenizers.models.WordPiece({"[UNK]": 0, "a": 1}))
    wordpiece.save(str(tmp_path / "wordpiece.json"))
    no_eot = gpt2_like_tokenizer(tmp_path / "no-eot.json", "the sea and the sky " * 20)
    spec = json.loads(no_eot.read_text())
    spec["added_tokens"] = []
    no_eot.write_text(json.dumps(spec))
    chars = json.loads(no_eot.read_text()) | {"decoder": None}
    (tmp_path / "chars.json").write_text(json.dumps(chars))
    (tmp_path / "broken.json").write_text("{not json")
    (generation / "small.txt").write_text("the sea and the sky\n" * 50)
    for given, says in (
        (
            "wordpiece",
            "--tokenizer must be char, byte, bpe or a tokenizer.json file, got 'wordpiece'",
        ),
        (tmp_path / "missing.json", "not a readable tokenizer.json"),
        (tmp_path / "broken.json", "not a readable tokenizer.json"),
        (tmp_path / "wordpiece.json", "not a BPE tokenizer.json (as GPT-2's)"),
        (tmp_path / "chars.json", "a BPE over characters, not bytes (as GPT-2's)"),
        (no_eot, "no <|endoftext|> token to end documents with"),
    ):
        out = tmp_path / "out"
        done = run(generation, "prepare", "--data", "small.txt", "--tokenizer", given, "--out", out)
        assert done.returncode == 2, (given, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
        assert not out.exists()
