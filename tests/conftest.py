"""Session fixtures shared by all tests: tiny models and a synthetic dataset, built once per session.

They are built into pytest's per-session temporary folder rather than cached under ``assets/``:
building all the models and the dataset takes well under a second once torch and transformers are
imported, so a cache would save little, while building fresh means every run tests the current
builder code (a stale cache could hide a change), never writes into the repository, and lets parallel
sessions run side by side. Code that wants the persistent copies (the demo) uses
``mmrl.demo.tiny.ensure_tiny_model`` instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Child processes (spawned ranks, Ray workers) inherit these: one OpenMP thread each, since the test
# machine has 2 cores shared by several processes; no tokenizers thread pool that forking would break.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Threads of the test process itself; tiny models gain nothing from more. Under pytest-xdist each
# worker takes one (the workers share the cores).
TEST_TORCH_THREADS = int(
    os.environ.get("MMRL_TEST_TORCH_THREADS", "1" if "PYTEST_XDIST_WORKER" in os.environ else "2")
)


@pytest.fixture(autouse=True, scope="session")
def _limit_torch_threads():
    import torch

    torch.set_num_threads(min(TEST_TORCH_THREADS, os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope="session")
def _collections_skip_the_collected_modules(_limit_torch_threads):
    """The modules the collected tests imported (torch, transformers, ...) live as long as this process:
    its collections skip them from here on, as a driver's and a rank's do (mmrl.runtime.startup)."""
    from mmrl.runtime.startup import freeze_heap

    freeze_heap()


@pytest.fixture(autouse=True, scope="session")
def _no_stale_debris():
    """What killed runs (an interrupted session included) left: vLLM shared memory that would block the
    next TP=2 engine, Ray sessions and their orphans, temp folders. Only debris of dead processes goes,
    so sessions running side by side are safe."""
    from mmrl.runtime.debris import clean_stale_debris

    clean_stale_debris()


@pytest.fixture(autouse=True, scope="session")
def _private_mmrl_cache(tmp_path_factory):
    """Prompt-length caches (mmrl.data.lengths) of the tests go to a session folder, not the user's."""
    os.environ["MMRL_CACHE_DIR"] = str(tmp_path_factory.mktemp("mmrl-cache"))


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_vl_path(tiny_models_dir) -> Path:
    """A tiny random Qwen2.5-VL (seed 0): AutoModelForImageTextToText + AutoProcessor."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen2_5_vl"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_omni_path(tiny_models_dir) -> Path:
    """A tiny random Qwen2.5-Omni (thinker weights only, seed 0):
    Qwen2_5OmniThinkerForConditionalGeneration + AutoProcessor."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen2_5_omni"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_text_path(tiny_models_dir) -> Path:
    """A tiny random Qwen2 text model (seed 0): AutoModelForCausalLM + AutoTokenizer."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen2"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_path(tiny_models_dir) -> Path:
    """A tiny random Qwen3-VL (seed 0): AutoModelForImageTextToText + AutoProcessor."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen3_vl"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe_path(tiny_models_dir) -> Path:
    """A tiny random Qwen3-VL MoE (4 experts, top-2, seed 0): AutoModelForImageTextToText + AutoProcessor."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen3_vl_moe"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_glm4v_path(tiny_models_dir) -> Path:
    """A tiny random GLM-4.1V (seed 0): AutoModelForImageTextToText + AutoProcessor (Glm4vProcessor)."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "glm4v"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_5_path(tiny_models_dir) -> Path:
    """A tiny random Qwen3.5 (a gated delta net, then a full-attention layer; seed 0)."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen3_5"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_path(tiny_models_dir) -> Path:
    """A tiny random Qwen3.5 MoE (Qwen3.5's two layers, each MLP 4 routed experts, top-2, and a shared
    expert; seed 0)."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen3_5_moe"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_omni_path(tiny_models_dir) -> Path:
    """A tiny random Qwen3-Omni thinker (MoE decoder, vision and audio towers; seed 0), saved as the full
    ``Qwen3OmniMoeForConditionalGeneration`` without talker; ``AutoProcessor`` (Qwen3OmniMoeProcessor)."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen3_omni_moe"
    return build_tiny_model(kind, tiny_model_path(kind, "tiny", tiny_models_dir), "tiny", seed=0)


@pytest.fixture(scope="session")
def real_width_vl_path(tiny_models_dir) -> Path:
    """A Qwen2.5-VL with the 3B model's widths and real vocabulary (151,936, tied), 2 decoder layers and
    2 vision blocks, random weights (seed 0; 0.54B parameters, 2.2 GB of fp32 safetensors)."""
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    kind = "qwen2_5_vl"
    return build_tiny_model(kind, tiny_model_path(kind, "3b-width", tiny_models_dir), "3b-width", seed=0)


@pytest.fixture(scope="session")
def shapes_data_dir(tmp_path_factory) -> Path:
    """The ``color`` task as jsonl: 32 train / 8 val rows (seed 0), images under ``images/``."""
    from mmrl.demo.synthetic import generate_shapes_dataset

    out_dir = tmp_path_factory.mktemp("data") / "shapes-color"
    return generate_shapes_dataset("color", out_dir, n_train=32, n_val=8, seed=0, fmt="jsonl")


@pytest.fixture(scope="session")
def image_video_data_dir(shapes_data_dir, tmp_path_factory) -> Path:
    """``train.jsonl``: the colour task's 32 rows with every odd row a video row of the dot task (8
    frames of 56x56), media paths absolute: a training file whose loader batches mix images and
    videos (with ``VIDEO_OVERRIDES`` of tests/_trainer_run.py every prompt fits in 64 tokens)."""
    import json

    from mmrl.demo.synthetic import generate_shapes_dataset

    out_dir = tmp_path_factory.mktemp("data") / "image-video"
    video_dir = generate_shapes_dataset("video_direction", out_dir / "videos", n_train=16, n_val=1, seed=0)
    image_rows = (shapes_data_dir / "train.jsonl").read_text().splitlines()
    video_rows = iter((video_dir / "train.jsonl").read_text().splitlines())
    rows = []
    for index, line in enumerate(image_rows):
        row, media_dir, key = json.loads(line), shapes_data_dir, "images"
        if index % 2:
            row, media_dir, key = json.loads(next(video_rows)), video_dir, "videos"
        rows.append({**row, key: [str(media_dir / path) for path in row[key]]})
    (out_dir / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out_dir


# ---- parallel workers (pytest-xdist: `make test` runs `-n 2 --dist loadgroup`) --------------------------

SHARED_SCOPES = ("module", "class", "package")
# session fixtures too costly to build in every worker: their users run in one (the 2.2 GB model; the
# tool-calling model's ~50 s of supervised steps, for the LoRA and stream runs)
COSTLY_SESSION_FIXTURES = {"real_width_vl_path": "real_width", "tool_calling_vl_path": "tool_calling"}


def _cost(item) -> float:
    """A rough guess of an item's seconds, to hand the workers their longest groups first: a slow test's
    own ``@pytest.mark.slow(seconds=...)`` where it is far from the usual 25 s (a 300 s test handed out
    last would keep one worker busy for minutes after the other ran out of work)."""
    if slow := item.get_closest_marker("slow"):
        return float(slow.kwargs.get("seconds", 25.0))
    return 2.0 if item.get_closest_marker("distributed") else 0.2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Each item gets the pytest-xdist group of the tests it must run beside in one worker: those that
    share a module-scoped fixture instance (a trainer run read by several tests is made once) or a
    costly session fixture, or name the same machine-wide resource with ``@pytest.mark.shares(name)``
    (vLLM engines' shared-memory names, sandboxed processes counted machine-wide). Items sharing nothing
    spread over the workers one by one; under xdist the groups go out longest first."""
    parent: dict[str, str] = {}

    def find(node: str) -> str:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    links = {}
    for item in items:
        nodes = [f"resource:{mark.args[0]}" for mark in item.iter_markers("shares")]
        fixtures = getattr(item, "_fixtureinfo", None)
        for name, defs in fixtures.name2fixturedefs.items() if fixtures else ():
            if defs and defs[-1].scope in SHARED_SCOPES:
                nodes.append(f"fixture:{item.module.__name__}:{name}")
            elif name in COSTLY_SESSION_FIXTURES:
                nodes.append(f"resource:{COSTLY_SESSION_FIXTURES[name]}")
        links[item.nodeid] = nodes
        for node in nodes[1:]:
            parent[find(node)] = find(nodes[0])
    scopes = {}
    for item in items:
        scopes[item.nodeid] = find(links[item.nodeid][0]) if links[item.nodeid] else item.nodeid
        if links[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(scopes[item.nodeid]))
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the workers' order is the one the groups go out in
        return
    cost, first = {}, {}
    for index, item in enumerate(items):
        scope = scopes[item.nodeid]
        cost[scope] = cost.get(scope, 0.0) + _cost(item)
        first.setdefault(scope, index)
    items.sort(key=lambda item: (-cost[scopes[item.nodeid]], first[scopes[item.nodeid]]))
    # the group as loadgroup reads it: the node id's "@" suffix. pytest-xdist 3.8 writes it to
    # ``item._nodeid``, which pytest 9 no longer reads (node ids are ``item._id``), so it is written here.
    from _pytest.nodeid import NodeId

    for item in items:
        if links[item.nodeid]:
            item._id = NodeId.parse(f"{item.nodeid}@{scopes[item.nodeid]}")


# the agent demo's tool: one call without arguments, returning an image (tests/_trainer_run.py has it too)
ZOOM_CENTER_TOOL = Path(__file__).resolve().parents[1] / "examples/tools/zoom_center.py"


@pytest.fixture(scope="session")
def tool_calling_vl_path(tiny_vl_path, shapes_data_dir, image_video_data_dir, tmp_path_factory):
    """The tiny Qwen2.5-VL taught to open every turn with a call of ``zoom`` (supervised on the first
    turn of 3 training prompts: row 0 of the colour task, row 2 lengthened as ``with_longer_prompts``
    does, and a video row of image_video; after the tool's image it calls again, and ``max_turns`` ends
    it), for the trainer runs with multi-turn rollouts (tests/trainer: LoRA, streaming, one step off).
    It samples the whole call on ~89 % of the colour task's prompts, lengthened or not, and of
    image_video's images and videos alike. Not taught a lengthened prompt, it never called on one: a
    streamed step trains the groups that end first, and once trained only groups without a call."""
    import torch
    from _trainer_run import with_longer_prompts

    from mmrl.agent.loop import tool_schemas
    from mmrl.config import MultiTurnConfig
    from mmrl.data.collate import collate_prompts
    from mmrl.data.config import DataConfig
    from mmrl.data.dataset import PromptDataset
    from mmrl.data.processing import attach_media, load_tokenizer_and_processor
    from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
    from mmrl.demo.warmup import answer_batch, save_trained, tool_call_text
    from mmrl.models.inputs import response_head_outputs
    from mmrl.models.loading import load_model

    torch.manual_seed(0)
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    model = load_model(str(tiny_vl_path))
    schemas = tool_schemas(MultiTurnConfig(enable=True, tools=[str(ZOOM_CENTER_TOOL)]))
    config = DataConfig(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, video_min_pixels=MIN_PIXELS, video_max_pixels=MAX_PIXELS
    )
    longer = with_longer_prompts(shapes_data_dir, tmp_path_factory.mktemp("tool-calling-data") / "longer")
    images, lengthened, videos = (
        PromptDataset(str(data_dir / "train.jsonl"), tokenizer, processor, config, tools=schemas)
        for data_dir in (shapes_data_dir, longer, image_video_data_dir)
    )
    rows = [images[0], lengthened[2], videos[1]]  # image_video's odd rows are its videos
    prompts = attach_media(collate_prompts(rows, tokenizer.pad_token_id), images.media)
    call = tool_call_text("zoom")
    width = len(tokenizer.encode(call, add_special_tokens=False)) + 1
    responses = answer_batch([call] * len(rows), tokenizer, width)  # the call, then EOS
    input_ids = torch.cat([prompts.batch["input_ids"], responses], dim=-1)
    attention_mask = torch.cat([prompts.batch["attention_mask"], torch.ones_like(responses)], dim=-1)
    types = torch.cat([prompts.batch["mm_token_type_ids"], torch.zeros_like(responses)], dim=-1)
    media = list(prompts.non_tensor_batch["multi_modal_inputs"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    for _ in range(160):  # 34 tokens at p 0.99 each: the whole call 0.74 after 80 steps, 0.89 after 160
        logits = response_head_outputs(model, input_ids, attention_mask, width, media, types)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), responses)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = tmp_path_factory.mktemp("tool-calling") / "model"
    save_trained(out, model, tiny_vl_path, tokenizer, processor, {"call": call, "loss": loss.item()})
    return out
