"""LoRA adapters inside the Generator: jobs with different mixes against running alone, generators on several
threads, prefix pages across adapter changes, and changes (merge, unload, the active mix) under queued or running
jobs. Adapters are random, written in PEFT's file layout (test_lora.make_adapter)."""
from __future__ import annotations

import pytest
import torch

from exl_core.errors import LoraError
from exl_core.model.lora import load_lora, lora_manager, set_active
from generator_support import run_all
from test_lora import _fresh, make_adapter


def test_generator_jobs_with_different_adapters_match_running_alone(tiny_llama_dir, tmp_path):
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    model = _fresh(tiny_llama_dir)
    load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, std=0.3), name="a")
    load_lora(model, make_adapter(tmp_path / "b", tiny_llama_dir, std=0.3), name="b")
    s = SamplerSettings(temperature=0.0)
    mixes = [{"a": 1.0}, {"b": 1.0}, {"a": 0.5, "b": 0.5}, None]
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (4, 9, 6, 5)]

    def run(pairs):
        gen = Generator(model, Cache(model, max_tokens=1024, page_size=16), None)
        jobs = [Job(p, max_new_tokens=8, sampler=s, stop_on_eos=False, loras=m) for p, m in pairs]
        gen.enqueue(jobs)
        run_all(gen)
        return [j.generated for j in jobs]

    together = run(list(zip(prompts, mixes)))
    alone = [run([(p, m)])[0] for p, m in zip(prompts, mixes)]
    assert together == alone
    # the adapters change the greedy output (else the test could not fail)
    assert run([(prompts[0], None)])[0] != together[0] or run([(prompts[1], None)])[0] != together[1]
    with pytest.raises(LoraError, match="no adapter named"):
        Generator(model, Cache(model, max_tokens=256, page_size=16), None).enqueue(
            Job(prompts[0], loras={"zzz": 1.0}))


def test_generators_on_threads_keep_their_own_jobs_adapters(tiny_llama_dir, tmp_path, monkeypatch):
    """Two generators of one model step on their own threads, each under its own lock: each forward must use its own
    jobs' mixes (the row plan was one attribute of the model's manager, so a forward ran with the other's plan)."""
    import threading
    import time

    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    from exl_core.model.lora import LoraHook
    model = _fresh(tiny_llama_dir)
    load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, std=0.3, seed=1), name="a")
    load_lora(model, make_adapter(tmp_path / "b", tiny_llama_dir, std=0.3, seed=2), name="b")
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (7, 5)]
    mixes = [{"a": 1.0}, {"b": 1.0}]

    def run(prompt, mix, out, key):
        gen = Generator(model, Cache(model, max_tokens=256, page_size=16), None)
        job = Job(prompt, max_new_tokens=6, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False, loras=mix)
        gen.enqueue(job)
        run_all(gen)
        out[key] = job.generated
    alone: dict = {}
    for k in (0, 1):
        run(prompts[k], mixes[k], alone, k)
    real_call = LoraHook.__call__

    def slow_call(self, x, y):         # a thread switch inside a forward, as any op releasing the GIL allows
        time.sleep(0.0005)
        return real_call(self, x, y)
    monkeypatch.setattr(LoraHook, "__call__", slow_call)
    for _ in range(3):
        got: dict = {}
        threads = [threading.Thread(target=run, args=(prompts[k], mixes[k], got, k)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == alone


def test_adapters_in_use_by_jobs_are_not_unloaded_or_merged(tiny_llama_dir, tmp_path):
    """Unloading (or merging) an adapter that a queued or running job names used to leave the generator raising on
    every iterate(), its jobs never finishing."""
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    model = _fresh(tiny_llama_dir)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, seed=3), name="a")
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), None)
    s = SamplerSettings(temperature=0.0)
    jobs = [Job([1, 2, 3], max_new_tokens=4, sampler=s, stop_on_eos=False, loras={"a": 1.0}),
            Job([4, 5, 6], max_new_tokens=4, sampler=s, stop_on_eos=False)]
    gen.enqueue(jobs)
    for attempt in (a.unload, a.merge):
        with pytest.raises(LoraError, match="1 queued or running job uses it"):
            attempt()
    gen.iterate()
    with pytest.raises(LoraError, match="1 queued or running job uses it"):
        a.unload()
    run_all(gen)
    assert [len(j.generated) for j in jobs] == [4, 4]
    a.unload()                                                # nothing uses it now
    assert lora_manager(model) is None                        # the last adapter gone: no manager left


def _greedy(gen, prompt, **kw):
    from exl_core.generation import Job
    from exl_core.generation.sampling import SamplerSettings
    job = Job(prompt, max_new_tokens=6, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False, **kw)
    gen.enqueue(job)
    while not job.done:
        gen.iterate()
    return job


def test_prefix_pages_are_not_reused_across_lora_changes(tiny_llama_dir, tmp_path):
    """A cached prompt prefix computed before activate() / merge() / an unload and reload under the same name was
    reused after it: the job read K/V of other weights (silently other tokens than on a fresh cache)."""
    from exl_core.cache import Cache
    from exl_core.generation import Generator
    model = _fresh(tiny_llama_dir)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, std=0.3, seed=1), name="a")
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    gen = Generator(model, Cache(model, max_tokens=512, page_size=16), None)

    def fresh():
        return _greedy(Generator(model, Cache(model, max_tokens=512, page_size=16), None), prompt).generated

    plain = _greedy(gen, prompt)
    assert plain.reused_tokens == 0
    assert _greedy(gen, prompt).reused_tokens == 32                     # same state: the prefix is shared
    a.activate()
    job = _greedy(gen, prompt)
    assert job.reused_tokens == 0 and job.generated == fresh() != plain.generated
    set_active(model, None)
    a.merge()
    job = _greedy(gen, prompt)
    assert job.reused_tokens == 0 and job.generated == fresh()
    a.unmerge()
    a.unload()
    load_lora(model, make_adapter(tmp_path / "a2", tiny_llama_dir, std=0.3, seed=2), name="a")
    job = _greedy(gen, prompt, loras={"a": 1.0})
    assert job.reused_tokens == 0
    assert job.generated == _greedy(Generator(model, Cache(model, max_tokens=512, page_size=16), None), prompt,
                                    loras={"a": 1.0}).generated


def test_jobs_without_a_mix_keep_the_active_one_when_batched_with_mixes(tiny_llama_dir, tmp_path):
    """With an active adapter, a job of no mix of its own ran without any adapter when batched beside a job that
    named one (its rows got an empty mix in the row plan): output depended on the batch."""
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    model = _fresh(tiny_llama_dir)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, std=0.3, seed=5), name="a")
    load_lora(model, make_adapter(tmp_path / "b", tiny_llama_dir, std=0.3, seed=6), name="b")
    a.activate()
    x = torch.randint(0, 49152, (7,), generator=torch.Generator().manual_seed(7)).tolist()
    y = torch.randint(0, 49152, (5,), generator=torch.Generator().manual_seed(8)).tolist()
    alone = _greedy(Generator(model, Cache(model, max_tokens=256, page_size=16), None), x).generated
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), None)
    s = SamplerSettings(temperature=0.0)
    jobs = [Job(x, max_new_tokens=6, sampler=s, stop_on_eos=False),
            Job(y, max_new_tokens=6, sampler=s, stop_on_eos=False, loras={"b": 1.0})]
    gen.enqueue(jobs)
    run_all(gen)
    assert jobs[0].generated == alone
    set_active(model, None)
    assert _greedy(Generator(model, Cache(model, max_tokens=256, page_size=16), None), x).generated != alone


def test_weights_do_not_change_under_queued_jobs(tiny_llama_dir, tmp_path):
    """merge / unmerge change every row, the active mix the rows of jobs without their own: refused while such jobs
    are queued or running (their K/V so far is of the old weights)."""
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    model = _fresh(tiny_llama_dir)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, seed=9), name="a")
    load_lora(model, make_adapter(tmp_path / "b", tiny_llama_dir, seed=10), name="b")
    plain = Generator(model, Cache(model, max_tokens=256, page_size=16), None)   # never sees a job with loras
    plain.enqueue(Job([7, 8], max_new_tokens=2))
    for change in (a.activate, a.merge):
        with pytest.raises(LoraError, match="1 queued or running job"):
            change()
    run_all(plain)
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), None)
    own = Job([1, 2, 3], max_new_tokens=2, loras={"b": 1.0})
    gen.enqueue(own)
    with pytest.raises(LoraError, match="1 queued or running job would mix"):
        a.merge()
    a.activate()                                       # the only job has its own mix: unaffected
    set_active(model, None)
    gen.enqueue(Job([4, 5], max_new_tokens=2))
    with pytest.raises(LoraError, match="without their own loras"):
        a.activate()
    run_all(gen)
    a.merge()
    gen.enqueue(Job([4, 5], max_new_tokens=2))
    with pytest.raises(LoraError, match="would mix"):
        a.unmerge()
    run_all(gen)
    a.unmerge()


def test_weight_changes_and_enqueues_do_not_interleave(tiny_llama_dir, tmp_path, monkeypatch):
    """The pending-jobs check and the change it allows were two steps: a job enqueued (or a step run) between them saw
    mixed weights. Now the change holds every generator's lock, and enqueue checks a job's mix again under it."""
    import threading
    import time
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    model = _fresh(tiny_llama_dir)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, seed=11), name="a")
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), None)
    with gen._lock:                                    # a step in progress
        t = threading.Thread(target=a.merge)
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and not a.merged           # the merge waits for it
    t.join(30)
    assert a.merged
    a.unmerge()
    validate = gen._validate

    def merge_after_validate(job):                     # a merge lands between a job's checks and its queueing
        validate(job)
        a.merge()
    monkeypatch.setattr(gen, "_validate", merge_after_validate)
    with pytest.raises(LoraError, match="merged into the weights"):
        gen.enqueue(Job([1, 2], max_new_tokens=2, loras={"a": 1.0}))
    assert not gen.has_work()


def test_a_generator_made_while_a_change_waits_for_the_locks_is_frozen_too(tiny_llama_dir, tmp_path, monkeypatch):
    """jobs_frozen locked the generators it found when it began: one made while it waited for a busy generator's lock
    (a step running) was not locked, and could enqueue and step on half-changed weights. The set is read again once
    the locks are held, until it holds no new generator. (A per-model change lock held through the change made such
    generators wait, but deadlocked a change asked for from a job's callback while another thread's change waited
    for that step's generator.)"""
    import threading
    from exl_core.cache import Cache
    from exl_core.generation import Generator
    from exl_core.model import lora as lora_mod
    model = _fresh(tiny_llama_dir)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, seed=11), name="a")
    busy = Generator(model, Cache(model, max_tokens=64), None)
    inside, release = threading.Event(), threading.Event()
    check = lora_mod.LoraManager.check_no_jobs

    def slow_check(self, what):                        # the merge stops inside its frozen section
        check(self, what)
        inside.set()
        assert release.wait(30)
    monkeypatch.setattr(lora_mod.LoraManager, "check_no_jobs", slow_check)
    with busy._lock:                                   # a step in progress on `busy`
        merger = threading.Thread(target=a.merge)
        merger.start()
        assert not inside.wait(0.3)                    # the merge waits for that step
        late = Generator(model, Cache(model, max_tokens=64), None)
    assert inside.wait(30)
    stepper = threading.Thread(target=late.iterate)
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive()                          # `late` is frozen by the merge too
    release.set()
    merger.join(30)
    stepper.join(30)
    assert a.merged and not stepper.is_alive()


def test_a_job_callback_may_ask_for_a_change_while_another_thread_waits_for_one(tiny_llama_dir, tmp_path):
    """A change asked for from a job's callback (inside its generator's step) while another thread's change waited
    for that generator: neither finished under the per-model change lock of the previous form."""
    import threading
    import time
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    model = _fresh(tiny_llama_dir)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, seed=11), name="a")
    b = load_lora(model, make_adapter(tmp_path / "b", tiny_llama_dir, seed=12), name="b")
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), None)
    waiting = threading.Event()
    other = threading.Thread(target=lambda: (waiting.set(), a.unload()), daemon=True)   # daemon: a deadlock fails

    def cb(r):
        if len(r.job.generated) == 1:
            other.start()
            waiting.wait(30)
            time.sleep(0.2)                              # the other thread now waits for this step's lock
            b.unload()                                   # no job uses it
    def run_all_gen():
        gen.enqueue(Job([1, 2, 3], max_new_tokens=3, sampler=SamplerSettings(temperature=0.0), callback=cb))
        while gen.has_work():
            gen.iterate()
    t = threading.Thread(target=run_all_gen, daemon=True)
    t.start()
    t.join(60)
    other.join(60)
    assert not t.is_alive() and not other.is_alive()
    assert lora_manager(model) is None
