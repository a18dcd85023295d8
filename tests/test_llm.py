"""LLMs through onnxruntime-genai, their decoder in an ephost worker: an unchanged genai application, with the
recipe the docs give (docs/llm.md):

    ephost.ort.register("npu", "onnxruntime")
    og.register_execution_provider_library("npu", ephost.ort.library_path())
    config = og.Config(folder); config.clear_providers(); config.append_provider("npu")

genai loads its own copy of ORT's library (its own OrtEnv), so it registers the library itself. The decoder is
the tiny one of llm_fixture (GroupQueryAttention, a KV cache shared between past and present); each test compares
greedy tokens against genai with ORT's CPU EP in process.
"""
from __future__ import annotations

import gc
import json
import os
import signal

import pytest

og = pytest.importorskip("onnxruntime_genai")  # in the test extras: skipped only where it is not installed

import ephost.ort  # noqa: E402
from ephost.errors import EpNotFound  # noqa: E402
import llm_fixture as F  # noqa: E402

PROMPT = F.prompt(8)
NEW = 24  # tokens generated per generation: PROMPT and these fit max_length (32)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = F.write(tmp_path_factory.mktemp("decoder"), max_length=len(PROMPT) + NEW)
    return folder, F.greedy(folder, PROMPT, NEW)


@pytest.fixture(scope="module")
def npu():
    """'npu' for both ORT copies in the process: the onnxruntime module's (ephost.ort.register) and genai's."""
    ephost.ort.register("npu", "onnxruntime")
    og.register_execution_provider_library("npu", ephost.ort.library_path())
    yield "npu"
    og.unregister_execution_provider_library("npu")
    ephost.ort.unregister("npu")


def on(folder, provider: str):
    config = og.Config(os.fspath(folder))
    config.clear_providers()
    config.append_provider(provider)
    return og.Model(config)


def test_the_fixture_is_genais_layout_and_decodes_through_its_kv_cache(tmp_path):
    """The fixture is what the builder makes (names, GQA, shared KV), and its tokens depend on the KV cache:
    genai's greedy tokens equal a full recompute of the sequence by ORT alone each step."""
    import numpy as np
    import onnxruntime as ort
    folder = F.write(tmp_path, max_length=len(PROMPT) + NEW)
    model = F.model()
    assert [i.name for i in model.graph.input][:5] == ["input_ids", "attention_mask", "position_ids",
                                                      "past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in model.graph.output][:3] == ["logits", "present.0.key", "present.0.value"]
    assert sum(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in model.graph.node) == 2
    with open(os.path.join(folder, "genai_config.json")) as f:
        assert json.load(f)["search"]["past_present_share_buffer"] is True

    session, shape, sequence, recomputed = ort.InferenceSession(F.model().SerializeToString()), F.Shape(), \
        list(PROMPT), []
    for _ in range(NEW):
        n = len(sequence)
        feeds = {"input_ids": np.array([sequence], np.int64), "attention_mask": np.ones((1, n), np.int64),
                 "position_ids": np.arange(n, dtype=np.int64)[None]}
        for i in range(shape.layers):
            for kind in ("key", "value"):
                feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, shape.kv_heads, 0, shape.head_size), np.float32)
        recomputed.append(int(session.run(["logits"], feeds)[0][0, -1].argmax()))
        sequence.append(recomputed[-1])
    tokens = F.greedy(folder, PROMPT, NEW)
    assert tokens == recomputed
    assert len(set(tokens)) > 4, "the tokens are not one short cycle"


def test_genai_decodes_through_the_bridge_token_for_token(decoder, npu):
    folder, expected = decoder
    before = ephost.ort.stats(npu)
    model = on(folder, npu)
    assert F.greedy(model, PROMPT, NEW) == expected
    crossed = ephost.ort.stats(npu)
    # one Compute per model run (the whole decoder is one partition in the worker): the prompt, then a token each
    assert crossed.computes - before.computes == NEW
    del model


def test_a_model_without_position_ids_rotates_inside_attention(tmp_path, npu):
    folder = F.write(tmp_path, F.Shape(position_ids=False), max_length=len(PROMPT) + NEW)
    expected = F.greedy(folder, PROMPT, NEW)
    model = on(folder, npu)
    assert F.greedy(model, PROMPT, NEW) == expected
    del model


def test_provider_options_in_genai_config_select_the_bridge_and_reach_the_workers_ep(tmp_path, decoder, npu,
                                                                                     monkeypatch):
    """"provider_options": [{"npu": {...}}] in genai_config.json, no code: genai appends the registered
    devices named "npu", and ORT hands the options to the bridge, which creates the worker's EP with them."""
    folder = F.write(tmp_path, max_length=len(PROMPT) + NEW,
                     provider_options=[{npu: {"intra_op_num_threads": "1"}}])
    factory = ephost.ort.environment(npu).registration(npu).factory
    seen = []
    create_ep = factory.create_ep
    monkeypatch.setattr(factory, "create_ep", lambda indices, options: seen.append(dict(options)) or
                        create_ep(indices, options))
    before = ephost.ort.stats(npu).computes
    model = og.Model(og.Config(folder))
    assert F.greedy(model, PROMPT, NEW) == decoder[1]
    assert seen == [{"intra_op_num_threads": "1"}]
    assert ephost.ort.stats(npu).computes - before == NEW
    del model


def test_genai_registering_before_ephost_is_told_what_to_do_and_can_register_after(decoder):
    """The library serves names bound by ephost.ort.register; genai registering one first gets ORT's error
    saying so, and registering again after ephost.ort.register works."""
    path = ephost.ort.library_path()
    with pytest.raises(Exception, match=r"ephost\.ort\.register"):
        og.register_execution_provider_library("early", path)
    ephost.ort.register("early", "onnxruntime")
    try:
        og.register_execution_provider_library("early", path)
        model = on(decoder[0], "early")
        assert F.greedy(model, PROMPT, NEW) == decoder[1]
        del model
        og.unregister_execution_provider_library("early")
    finally:
        ephost.ort.unregister("early")


def test_ephost_unregister_lets_go_in_both_copies_and_genai_may_go_first(decoder):
    """ephost.ort.unregister unregisters the name in every ORT copy that holds it (genai's too) and ends the
    worker; genai unregistering first leaves the worker to the onnxruntime module's copy until then. Either way the
    name can be registered again."""
    import helpers

    def registered() -> int:
        before = helpers.worker_pids()
        ephost.ort.register("both", "onnxruntime")
        og.register_execution_provider_library("both", ephost.ort.library_path())
        [worker] = helpers.worker_pids() - before
        model = on(decoder[0], "both")
        assert F.greedy(model, PROMPT, NEW) == decoder[1]
        del model
        gc.collect()
        return worker

    worker = registered()
    ephost.ort.unregister("both")
    assert worker not in helpers.worker_pids()
    with pytest.raises(Exception, match="not registered"):
        og.unregister_execution_provider_library("both")  # genai's registration went with it

    worker = registered()
    og.unregister_execution_provider_library("both")
    assert worker in helpers.worker_pids(), "the onnxruntime module's copy still holds it"
    assert ephost.ort.stats("both").computes == NEW
    ephost.ort.unregister("both")
    assert worker not in helpers.worker_pids()
    with pytest.raises(EpNotFound):
        ephost.ort.stats("both")
    ephost.ort.register("both", "onnxruntime")
    ephost.ort.unregister("both")


def test_a_model_used_after_its_ep_was_unregistered_fails_with_a_clear_error(decoder):
    ephost.ort.register("gone", "onnxruntime")
    og.register_execution_provider_library("gone", ephost.ort.library_path())
    model = on(decoder[0], "gone")
    og.unregister_execution_provider_library("gone")
    ephost.ort.unregister("gone")
    with pytest.raises(Exception, match="gone.*was unregistered") as failure:
        F.greedy(model, PROMPT, NEW)
    assert "AttributeError" not in str(failure.value)
    del model, failure


def test_a_worker_crash_mid_step_is_that_steps_error_and_a_new_generation_is_right(decoder):
    """The worker segfaults inside the decoder's sixth run. genai raises ORT's error naming the EP and the
    signal; genai advanced that generator's state before the step, so the application starts a new one, which
    runs on the restarted worker (recompiled from what the bridge recorded) and is right. (The chaos EP counts
    from 1 in each worker: the new generation stays under six runs.)"""
    ephost.ort.register("crashy", "chaos", {"wrap": "onnxruntime", "fault": "segfault", "at": "compute",
                                            "after": "6"})
    og.register_execution_provider_library("crashy", ephost.ort.library_path())
    try:
        model = on(decoder[0], "crashy")
        pid = ephost.ort.environment("crashy").registration("crashy").process.pid
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(PROMPT) + NEW)
        generator = og.Generator(model, params)
        generator.append_tokens(PROMPT)  # the first run
        for _ in range(5):  # runs 2 to 5 (the first step runs nothing: the prompt's run made its logits)
            generator.generate_next_token()
        before = ephost.ort.stats("crashy")
        with pytest.raises(Exception, match=r"crashy: Compute of .*(SIGSEGV|signal 11)"):
            generator.generate_next_token()
        failed = ephost.ort.stats("crashy")
        # the failed step is counted, with the bytes it copied toward the worker (its inputs) and none back
        assert (failed.computes - before.computes, failed.bytes_out_copied - before.bytes_out_copied) == (1, 0)
        assert failed.bytes_in_copied - before.bytes_in_copied >= 8 * (len(PROMPT) + 5), "its attention mask"
        del generator, params
        assert F.greedy(model, PROMPT, 5) == decoder[1][:5]
        assert ephost.ort.environment("crashy").registration("crashy").process.pid != pid
        del model
    finally:
        gc.collect()
        og.unregister_execution_provider_library("crashy")
        ephost.ort.unregister("crashy")


def test_a_worker_killed_between_generations_or_between_steps_costs_nothing(decoder):
    """SIGKILL the worker between two generations, and between two steps of one: no step fails and every token
    is right (genai's own memory holds the KV cache; the next run recompiles on the restarted worker)."""
    import helpers
    ephost.ort.register("victim", "onnxruntime")
    og.register_execution_provider_library("victim", ephost.ort.library_path())
    try:
        registration = ephost.ort.environment("victim").registration("victim")
        model = on(decoder[0], "victim")
        assert F.greedy(model, PROMPT, NEW) == decoder[1]

        def kill() -> int:
            process = registration.process
            os.kill(process.pid, signal.SIGKILL)
            assert process.exited.wait(10)
            return process.pid

        killed = [kill()]
        assert F.greedy(model, PROMPT, NEW) == decoder[1]
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(PROMPT) + NEW)
        generator = og.Generator(model, params)
        generator.append_tokens(PROMPT)
        tokens = []
        while not generator.is_done():
            if len(tokens) == NEW // 2:
                killed.append(kill())
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        assert tokens == decoder[1]
        assert registration.process.pid not in killed and not set(killed) & helpers.worker_pids()
        del generator, params, model
    finally:
        gc.collect()
        og.unregister_execution_provider_library("victim")
        ephost.ort.unregister("victim")


def decode_steps(model, prompt: list[int], max_length: int, name: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The tokens of one generation, and the bytes the bridge copied in and out on each decoding step."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    tokens, crossed = [], []
    while not generator.is_done():
        before = ephost.ort.stats(name)
        generator.generate_next_token()
        after = ephost.ort.stats(name)
        tokens.append(int(generator.get_next_tokens()[0]))
        if after.computes > before.computes:
            crossed.append((after.bytes_in_copied - before.bytes_in_copied,
                            after.bytes_out_copied - before.bytes_out_copied))
    del generator, params
    return tokens, crossed


def test_the_kv_cache_stays_in_the_worker_a_token_costs_its_own_bytes_at_any_context(tmp_path, npu):
    """genai hands every step its whole KV cache (allocated at max_length, past and present in one memory). The
    worker keeps a copy of it: each step copies only the chunks that changed (the new token's rows) in and out,
    so the bytes per token are about the same at a context of 128 and of 1,024, and far below the cache's."""
    folder = F.write(tmp_path, max_length=1024)
    model = on(folder, npu)
    per_token = {}
    for context in (128, 1024):
        prompt = F.prompt(context - 8)
        tokens, crossed = decode_steps(model, prompt, context, npu)
        assert tokens == F.greedy(folder, prompt, 8, max_length=context)
        steady = crossed[2:]  # the first steps make the worker's copies
        per_token[context] = max(i + o for i, o in steady)
        assert per_token[context] < F.Shape().kv_bytes(context) / 16, (context, steady)
    assert per_token[1024] <= 1.5 * per_token[128], per_token
    del model


def test_each_token_repeats_the_workers_kept_call_writes_the_kv_cache_in_place_and_counts_its_bytes(tmp_path, npu):
    """The attention mask grows a token every step, yet each step after the second repeats the call the worker's
    fast lane keeps, and the worker's ORT writes the four presents into genai's shared past/present memory (the
    worker's copy of it) in place: none is copied there after the run. ephost.ort.stats counts every byte the
    step copied: in, input_ids, position_ids and the attention mask (under the size a copy is kept for: whole);
    out, the logits and the new token's row of each KV tensor, nothing of the rest of the cache."""
    shape, prompt = F.Shape(), F.prompt(16)
    folder = F.write(tmp_path, max_length=64)
    model = on(folder, npu)
    env = ephost.ort.environment(npu)

    def counts() -> tuple[int, ...]:
        crossed, served = ephost.ort.stats(npu), env.get_worker_stats(npu)
        return (crossed.computes, crossed.bytes_in_copied, crossed.bytes_out_copied, served.kept_calls,
                served.calls_kept, served.compute_outputs_in_place, served.compute_outputs_copied)

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=40)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    steps, tokens = [], []
    while not generator.is_done():
        before = counts()
        generator.generate_next_token()
        steps.append(tuple(b - a for a, b in zip(before, counts())))
        tokens.append(int(generator.get_next_tokens()[0]))
    del generator, params
    assert tokens == F.greedy(folder, prompt, 24, max_length=40)
    ran = [s for s in steps if s[0]]  # (the first step runs nothing: the prompt's run made its logits)
    assert len(ran) == 23
    kv_row = shape.layers * 2 * shape.kv_heads * shape.head_size * 4
    for k, step in enumerate(ran[1:], start=2):  # (the first makes the worker's copies)
        mask = 8 * (len(prompt) + k)
        # The first step sends the pasts as they are (no copy by position for an input that did not grow); from
        # the second they go as the worker's copies of what the first wrote there: the call is kept anew once.
        repeated, kept_anew = (0, 1) if k == 2 else (1, 0)
        assert step == (1, 8 + 8 + mask, shape.vocab * 4 + kv_row, repeated, kept_anew, 4, 0), k
    del model


def test_ephosts_own_session_decodes_over_one_kv_buffer_per_tensor_in_the_worker_in_place(decoder):
    """ephost's InferenceSession runs the decoder as genai does with its shared buffer: each past and its present
    bound to ONE tensor in the worker's memory, allocated at max_length, the attention mask a token longer every
    step. The first run (the prompt) is kept by the worker's fast lane and every later step repeats it, whatever its
    shapes; the worker's ORT writes the four presents in place (none copied after the run); the tokens are genai's."""
    import numpy as np
    import ephost
    from ephost import InferenceSession, Tensor
    from helpers import options_for
    shape, max_length = F.Shape(), len(PROMPT) + NEW
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime", {"intra_op_num_threads": "1"})
        device = next(d for d in env.get_ep_devices() if d.registration_name == "ort")
        allocator = env.allocator_for(device.memory_info(ephost.DeviceMemoryType.HOST_ACCESSIBLE))
        with InferenceSession(F.model(), options_for(env, "ort"), env=env) as session:
            binding = session.io_binding()
            for layer in range(shape.layers):
                for kind in ("key", "value"):
                    kv = Tensor.empty((1, shape.kv_heads, max_length, shape.head_size), np.float32, allocator)
                    binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", kv)
                    binding.bind_ortvalue_output(f"present.{layer}.{kind}", kv)
            binding.bind_output("logits")

            def served() -> tuple[int, ...]:
                stats = env.get_worker_stats("ort")
                return stats.kept_calls, stats.calls_kept, stats.compute_outputs_in_place, stats.compute_outputs_copied

            tokens, steps = [], []
            while len(tokens) < NEW:
                total = len(PROMPT) + len(tokens)
                new = PROMPT if not tokens else tokens[-1:]
                binding.bind_cpu_input("input_ids", np.array([new], np.int64))
                binding.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
                binding.bind_cpu_input("position_ids", np.arange(total - len(new), total, dtype=np.int64)[None])
                before = served()
                session.run_with_iobinding(binding)
                steps.append(tuple(b - a for a, b in zip(before, served())))
                tokens.append(int(binding.get_outputs()[-1].numpy()[0, -1].argmax()))
    assert tokens == decoder[1]
    assert steps == [(0, 1, 4, 0)] + [(1, 0, 4, 0)] * (NEW - 1)


def test_genais_kv_cache_after_a_generation_through_the_bridge_is_its_own_byte_for_byte(decoder, npu):
    """The worker writes the present into its copy of genai's memory in place and the bridge brings out what
    changed: genai's shared KV cache ends as it would in process, to the last row past the sequence."""
    import numpy as np

    def cache_after(model) -> list:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(PROMPT) + NEW)
        generator = og.Generator(model, params)
        generator.append_tokens(PROMPT)
        while not generator.is_done():
            generator.generate_next_token()
        cache = [generator.get_output(f"present.{i}.{kind}") for i in range(F.Shape().layers)
                 for kind in ("key", "value")]
        del generator, params
        return cache

    alone, bridged = og.Model(og.Config(decoder[0])), on(decoder[0], npu)
    for expected, got in zip(cache_after(alone), cache_after(bridged)):
        assert expected.shape == (1, F.Shape().kv_heads, len(PROMPT) + NEW, F.Shape().head_size)
        np.testing.assert_array_equal(got, expected)
    del alone, bridged


def test_without_the_shared_buffer_the_past_stays_in_the_worker(tmp_path, npu):
    """Without past_present_share_buffer genai makes a new present every step (its memory, its length) and passes
    it as the next past: the present must reach genai's memory (what differs from what that memory held), but the
    past is the worker's copy of that same memory (nothing copied in but what changed)."""
    folder = F.write(tmp_path, max_length=256)
    config = json.load(open(os.path.join(folder, "genai_config.json")))
    config["search"]["past_present_share_buffer"] = False
    json.dump(config, open(os.path.join(folder, "genai_config.json"), "w"))
    model = on(folder, npu)
    prompt = F.prompt(200)
    tokens, crossed = decode_steps(model, prompt, 256, npu)
    assert tokens == F.greedy(folder, prompt, 56, max_length=256)
    kv = F.Shape().kv_bytes(230)
    assert all(i < kv / 16 for i, _ in crossed[2:]), crossed[:5]
    del model


def test_the_llm_bench_prints_genai_in_process_beside_the_bridge_per_token_at_two_contexts():
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "bench", "--quick", "llm"], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.stdout.splitlines() if line.startswith("| ")]
    assert rows[0][:4] == ["context (max_length)", "KV cache", "genai in process", "genai + bridge"]
    assert [r[0] for r in rows[1:]] == ["128", "1024"]
    for row in rows[1:]:
        assert row[2].endswith("µs") and row[3].endswith("µs") and row[6].endswith(" B") and row[7].endswith(" B")
