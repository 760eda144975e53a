"""Which checks each combination of the matrix gets (scaffold.matrix.twins), and the shards that
keep a twin with its primary."""

from __future__ import annotations

import collections
from pathlib import Path

from scaffold import matrix
from scaffold.combinations import combination_id


def _streaming_false(*only: str) -> list[dict]:
    """The combinations with streaming false (and `only`): the rules before streaming, whose
    plans the streaming half leaves as they were (its own tests below)."""
    return matrix.select(matrix.combinations(), ["streaming=no", *only])


def test_the_primaries_get_check_all_and_every_other_combination_is_their_twin():
    combos = _streaming_false()
    plans = matrix.plans(combos)

    by_id = {combination_id(c): c for c in combos}
    primaries = [c for c, p in zip(combos, plans, strict=True) if p.which == "all"]
    assert primaries and all(c["tracker"] == "none" and c["device"] == "cpu" for c in primaries)
    for answers, plan in zip(combos, plans, strict=True):
        if plan.which == "all" or answers["finetune"]:  # finetune ones: their own test below
            continue
        if by_id[plan.primary]["finetune"]:  # a finetune-false primary: its own test below
            continue
        primary = by_id[plan.primary]
        differs = {k for k in answers if answers[k] != primary[k]}
        assert differs and differs <= {"tracker", "device"}
        # a cross (a tracker on another device, an fsdp twin: its ddp sibling is in the run, or a
        # compile twin: the same twin without compile is) runs --help only; the rest, resume
        cross = differs == {"tracker", "device"} or answers["distributed"] == "fsdp"
        cross = cross or answers["compile"]
        assert plan.which == ("import" if cross else "resume")
        assert plan.options == ({"no_compile": None} if answers["compile"] else {})
    # every family (the answers twins share) has one primary for each accumulation
    families = collections.Counter(matrix.family(c) for c in primaries)
    assert set(families.values()) == {2}
    assert len({(matrix.family(c), c["grad_accum_steps"]) for c in primaries}) == len(primaries)
    assert set(families) == {matrix.family(c) for c in combos}


def test_a_twin_without_its_primary_in_the_run_gets_every_check():
    combos = matrix.select(matrix.combinations(), ["tracker=wandb"])
    assert combos and {p.which for p in matrix.plans(combos)} == {"all"}

    slice_ = _streaming_false("task=custom", "precision=bf16", "finetune=no")
    plans = matrix.plans(slice_)
    assert {p.which for p in plans} == {"all", "resume", "import"}
    assert {p.which for p in matrix.plans(slice_, full=True)} == {"all"}

    # without the device twins (tracker none), a tracker on cuda runs its own resume check
    custom = _streaming_false("task=custom", "finetune=no")
    no_device_twins = [
        c
        for c in custom
        if (c["tracker"] != "none" or c["device"] == "cpu")
        and c["distributed"] != "fsdp"
        and not c["compile"]
    ]
    plans = matrix.plans(no_device_twins)
    assert {p.which for p in plans} == {"all", "resume"}


def test_an_fsdp_twin_is_a_cross_exactly_when_its_ddp_sibling_is_in_the_run():
    combos = _streaming_false("task=regression", "finetune=no")
    fsdp_only = [c for c in combos if c["distributed"] == "fsdp"]
    for run in (combos, fsdp_only):
        present = {combination_id(c) for c in run}
        for answers, plan in zip(run, matrix.plans(run), strict=True):
            if answers["distributed"] != "fsdp" or plan.which == "all":
                continue
            sibling = combination_id({**answers, "distributed": "ddp"}) in present
            double = answers["tracker"] != "none" and answers["device"] != "cpu"
            uncompiled = {**answers, "compile": False}
            compiled = answers["compile"] and combination_id(uncompiled) in present
            assert plan.which == ("import" if sibling or double or compiled else "resume")
    assert "resume" in {p.which for p in matrix.plans(fsdp_only)}  # no sibling: its own resume


def test_a_compile_twin_resumes_itself_only_without_its_uncompiled_sibling():
    """A twin's resume runs with --no-compile: where the twin without compile is in the run, the
    compile twin would run the same lines again, and runs --help only."""
    combos = _streaming_false("task=classification", "distributed=none", "finetune=no")
    compiled_only = [c for c in combos if c["compile"]]
    counts = {}
    for run in (combos, compiled_only):
        plans = matrix.plans(run)
        twins = [
            p.which
            for c, p in zip(run, plans, strict=True)
            if c["compile"]
            and p.which != "all"
            and (c["tracker"] == "none") != (c["device"] == "cpu")
        ]
        counts[len(run)] = collections.Counter(twins)
    assert counts[len(combos)] == {"import": 30}  # 6 families x (3 trackers, cuda, mps)
    assert counts[len(compiled_only)] == {"resume": 30}
    combos = _streaming_false()
    assert collections.Counter(
        p.which for c, p in zip(combos, matrix.plans(combos), strict=True) if not c["finetune"]
    ) == {"all": 144, "resume": 270, "import": 1266}  # 36 finetune-false primaries' --help


def test_crosses_are_the_twins_differing_in_both_and_are_checked_last():
    combos = _streaming_false()
    plans = matrix.plans(combos)
    by_id = {combination_id(c): c for c in combos}
    crosses = [  # not the finetune-false primaries' --help (their own test below)
        c
        for c, p in zip(combos, plans, strict=True)
        if p.which == "import" and not c["finetune"] and not by_id[p.primary]["finetune"]
    ]
    assert crosses

    def differs_in_both(c):
        return c["tracker"] != "none" and c["device"] != "cpu"

    def fsdp_twin(c):
        return c["distributed"] == "fsdp" and (c["tracker"] != "none" or c["device"] != "cpu")

    def compile_twin(c):
        return c["compile"] and (c["tracker"] != "none" or c["device"] != "cpu")

    def cross(c):
        return differs_in_both(c) or fsdp_twin(c) or compile_twin(c)

    assert all(cross(c) for c in crosses)
    assert len(crosses) == sum(cross(c) for c in combos if not c["finetune"])
    kinds = [plans[i].which for i in matrix.schedule(combos, plans)]
    assert set(kinds[kinds.index("import") :]) == {"import", "lint"}


def test_with_the_checks_on_the_projects_own_device_only_the_tracker_makes_twins():
    combos = _streaming_false("device=cuda", "finetune=no")
    plans = matrix.plans(combos, native_device=True)

    primaries = [c for c, p in zip(combos, plans, strict=True) if p.which == "all"]
    assert {c["device"] for c in primaries} == {"cuda"}
    assert {c["tracker"] for c in primaries} == {"none"}
    assert len(primaries) == len(combos) // 4  # one of the four trackers


def test_shards_partition_the_matrix_and_keep_each_family_together():
    combos = matrix.combinations()
    shards = [matrix.shard(combos, f"{i}/8", key=matrix.family) for i in range(1, 9)]

    dealt = [combination_id(c) for s in shards for c in s]
    assert sorted(dealt) == sorted(combination_id(c) for c in combos)
    homes = collections.defaultdict(set)
    for i, s in enumerate(shards):
        for c in s:
            homes[matrix.family(c)].add(i)
    assert all(len(h) == 1 for h in homes.values())
    # every twin's primary is in its shard (no shard falls back to check all for its twins), and
    # a finetune combination's finetune primary and finetune-false twin: it plans as in the whole
    whole = dict(zip(dealt, matrix.plans([c for s in shards for c in s]), strict=True))
    for s in shards:
        shard_plans = dict(zip([combination_id(c) for c in s], matrix.plans(s), strict=True))
        for c in s:
            kind, in_whole = shard_plans[combination_id(c)].kind, whole[combination_id(c)].kind
            if c["finetune"] and kind != in_whole:
                # a shard without an fsdp family's ddp sibling (or a compile family's uncompiled
                # one) resumes its tracker twins: its finetune-false primary hands over check all
                assert (in_whole, kind) == ("resume+train+init", "all+train+init")
                false = shard_plans[combination_id({**c, "finetune": False})]
                assert (whole[combination_id({**c, "finetune": False})].kind, false.kind) == (
                    "all",
                    "import",
                )
        families = collections.Counter(
            c["streaming"] for c in {matrix.family(c): c for c in s}.values()
        )
        # accumulation 1 and 4 a family; one streaming primary a streaming family
        assert (
            sum(p.which == "all" for p in matrix.plans(s)) == 2 * families[False] + families[True]
        )
    sizes = [len(s) for s in shards]
    assert max(sizes) < 1.5 * min(sizes)


def test_the_slow_checks_start_first_and_the_twins_last():
    combos = matrix.combinations()
    plans = matrix.plans(combos)
    order = matrix.schedule(combos, plans)

    assert sorted(order) == list(range(len(combos)))
    families = {tuple(c[k] for k in matrix.COMPILE_FAMILY) for c in combos if c["compile"]}
    first = [combos[i] for i in order[: len(families)]]
    assert all(c["compile"] for c in first)
    assert all(plans[i].which == "all" for i in order[: len(families)])
    assert {tuple(c[k] for k in matrix.COMPILE_FAMILY) for c in first} == families
    kinds = [plans[i].kind for i in order]
    twins_start = next(n for n, i in enumerate(order) if plans[i].primary)
    assert set(kinds[twins_start:]) == {"resume", "import", "lint"}
    assert "all" not in kinds[twins_start:] and "resume+train+init" not in kinds[twins_start:]


def test_a_finetune_combination_runs_what_its_finetune_lines_need_and_no_more():
    """Its lines beyond its finetune-false twin's are the finetune blocks, which vary with task,
    distributed, precision and compile only: the finetune primary (tracker none, the CPU, no
    accumulation) runs check resume (EMA on, a freeze lifted mid-run), then check init from that
    run's best checkpoint; a combination one answer away from it imports its modules (--help);
    the rest are rendered and linted."""
    combos = _streaming_false()
    plans = matrix.plans(combos)
    by_id = {combination_id(c): c for c in combos}

    assert collections.Counter(
        p.kind for c, p in zip(combos, plans, strict=True) if c["finetune"]
    ) == {"resume+train+init": 36, "resume": 18, "all+train+init": 36, "import": 480, "lint": 1110}
    for answers, plan in zip(combos, plans, strict=True):
        if not answers["finetune"]:
            continue
        assert combination_id({**answers, "finetune": False}) in by_id
        home = {"tracker": "none", "device": "cpu", "grad_accum_steps": 1}
        differs = {k for k, v in home.items() if answers[k] != v}
        if not differs:
            assert plan.which in ("resume", "all")  # all: see the finetune-false primaries' test
            if answers["task"] in matrix.twins.UNTRAINED_AT_CHECK_SIZES:  # no source worth loading
                assert (plan.which, plan.then, plan.then_options) == ("resume", (), {})
                continue
            assert (plan.then, plan.options, plan.primary) == (
                ("train", "init"),
                {},
                None,
            )
            best = "best" if answers["distributed"] == "fsdp" else "best.pt"
            assert plan.then_options == {"init_from": f"{matrix.twins.INIT_SOURCE}/{best}"}
            continue
        assert plan.primary == combination_id({**answers, **home})
        assert plan.which == ("import" if len(differs) == 1 else "lint")
        assert plan.options == {}  # --help and lint compile nothing


def test_a_finetune_false_primary_hands_its_check_all_to_its_finetune_primary():
    """Where its model is the finetune render's and a tracker twin resumes its render, the
    finetune-false primary runs --help and its finetune primary check all (scaffold.matrix.twins
    says line by line why nothing goes unrun)."""
    combos = _streaming_false()
    plans = matrix.plans(combos)
    by_id = {combination_id(c): c for c in combos}
    plan_of = dict(zip(by_id, plans, strict=True))

    handed = {}
    for answers, plan in zip(combos, plans, strict=True):
        if not answers["finetune"] and plan.primary and by_id[plan.primary]["finetune"]:
            handed[combination_id(answers)] = answers
            assert plan.primary == combination_id({**answers, "finetune": True})
            assert (plan.which, plan.then) == ("import", ())
            finetune = plan_of[plan.primary]
            assert (finetune.which, finetune.then) == ("all", ("train", "init"))
    home = {"tracker": "none", "device": "cpu", "grad_accum_steps": 1}
    assert all(c.items() >= home.items() for c in handed.values())
    assert {(c["task"], c["distributed"], c["compile"]) for c in handed.values()} == {
        (task, distributed, compile)
        for task in ("classification", "regression", "custom")  # image and generation: own models
        for distributed in ("none", "ddp")  # fsdp's tracker twins are crosses (ddp resumes them)
        for compile in (False, True)  # compile's are too, but the uncompiled twin resumes them
    }
    assert len(handed) == 36  # and the 3 precisions
    # every other finetune primary still runs check resume, and its false twin check all
    for cid, plan in plan_of.items():
        answers = by_id[cid]
        if answers["finetune"] and plan.which in ("all", "resume") and not plan.primary:
            false = combination_id({**answers, "finetune": False})
            assert (plan.which == "all") == (false in handed)
            assert plan_of[false].which == ("import" if false in handed else "all")

    # no tracker twin resuming its render: the false primary keeps check all
    alone = matrix.select(combos, ["task=custom", "tracker=none", "device=cpu"])
    assert {
        p.which for c, p in zip(alone, matrix.plans(alone), strict=True) if not c["finetune"]
    } == {"all"}
    # an fsdp family without its ddp sibling: its tracker twins resume, so it hands over
    fsdp = matrix.select(combos, ["task=regression", "distributed=fsdp", "compile=no"])
    fsdp_plans = matrix.plans(fsdp)
    kinds = {
        (c["finetune"], p.kind)
        for c, p in zip(fsdp, fsdp_plans, strict=True)
        if c["tracker"] == "none" and c["device"] == "cpu" and c["grad_accum_steps"] == 1
    }
    assert kinds == {(False, "import"), (True, "all+train+init")}


def test_a_finetune_slice_without_its_finetune_false_twins_checks_itself():
    """Without the finetune-false twins, nothing runs a finetune combination's other lines: the
    twin rules apply within the slice, and each check all is followed by check init."""
    combos = matrix.select(matrix.combinations(), ["task=custom", "finetune=yes"])
    plans = matrix.plans(combos)

    assert {p.kind for p in plans} == {"all+train+init", "resume", "import"}
    for answers, plan in zip(combos, plans, strict=True):
        primary = answers["tracker"] == "none" and answers["device"] == "cpu"
        assert (plan.which == "all") == primary
    assert {p.kind for p in matrix.plans(combos, full=True)} == {"all+train+init"}
    # its finetune primary absent, a finetune twin is checked as one too
    lone = [c for c in combos if c["grad_accum_steps"] == 4 and c["tracker"] == "wandb"]
    falses = [{**c, "finetune": False} for c in lone]
    assert {p.kind for p in matrix.plans(lone + falses)[: len(lone)]} == {"all+train+init"}


# What a finetune combination's plan rests on: its finetune blocks read none of these answers, so
# one finetune primary a family runs every finetune line its family renders.
NOT_IN_FINETUNE_BLOCKS = {"tracker", "device", "grad_accum_steps"}


def _block_answers(source: str, whole: bool = False, answer: str = "finetune") -> set[str]:
    """The answers that the finetune lines of a template read: inside `{% if finetune %}` (or the
    `else` of `{% if not finetune %}`), or anywhere where the file itself is finetune's (or
    another `answer`'s lines)."""
    from jinja2 import Environment, nodes

    found: set[str] = set()

    def names(node) -> set[str]:  # find_all leaves out the node itself
        return {n.name for n in [node, *node.find_all(nodes.Name)] if isinstance(n, nodes.Name)}

    def walk(node, inside: bool) -> None:
        if inside:
            found.update(names(node))
            return
        if isinstance(node, nodes.If) and answer in names(node.test):
            negated = isinstance(node.test, nodes.Not)
            for child in node.else_ if negated else node.body:
                walk(child, True)
            for child in [*node.elif_, *(node.body if negated else node.else_)]:
                walk(child, False)
            return
        for child in node.iter_child_nodes():
            walk(child, False)

    walk(Environment().parse(source), whole)
    return found


def test_the_finetune_blocks_read_no_answer_a_finetune_primary_leaves_out():
    assert _block_answers("{% if finetune %}{{ device }}{% endif %}{{ tracker }}") == {"device"}
    assert _block_answers("{% if not finetune %}{{ tracker }}{% else %}x{% endif %}") == set()
    assert _block_answers("{{ grad_accum_steps }}", whole=True) == {"grad_accum_steps"}

    root = Path(__file__).resolve().parent.parent / "templates"
    for path in root.rglob("*.jinja"):
        whole = "finetune" in str(path.relative_to(root))
        read = _block_answers(path.read_text(encoding="utf-8"), whole)
        assert not read & NOT_IN_FINETUNE_BLOCKS, (path, read & NOT_IN_FINETUNE_BLOCKS)


def _finetune_false_answers(source: str) -> tuple[int, set[str]]:
    """How many finetune-false branches a template has (the `else` of `{% if finetune %}`, the
    body of `{% if not finetune %}`, `a if finetune else b`'s b) and the answers they read."""
    from jinja2 import Environment, nodes

    found: set[str] = set()
    branches = 0

    def names(node) -> set[str]:
        return {n.name for n in [node, *node.find_all(nodes.Name)] if isinstance(n, nodes.Name)}

    def walk(node) -> None:
        nonlocal branches
        if isinstance(node, nodes.If | nodes.CondExpr) and "finetune" in names(node.test):
            negated = isinstance(node.test, nodes.Not)
            if isinstance(node, nodes.CondExpr):
                body, other = [node.expr1], [node.expr2] if node.expr2 else []
            else:
                body, other = node.body, [*node.else_]
                for elif_ in node.elif_:  # `{% if finetune and task == ... %}`'s next test
                    walk(elif_)
            for child in body if negated else other:
                branches += 1
                found.update(names(child))
            for child in other if negated else body:
                walk(child)
            return
        for child in node.iter_child_nodes():
            walk(child)

    walk(Environment().parse(source))
    return branches, found


def test_the_finetune_false_branches_read_no_answer():
    """What a finetune-false primary hands over rests on it (scaffold.matrix.twins): the lines
    only a finetune-false render has are the same whatever the other answers, compile included,
    so its tracker twin's resume check, or that of the same twin without compile, runs them."""
    assert _finetune_false_answers("{% if finetune %}a{% else %}{{ compile }}{% endif %}") == (
        1,
        {"compile"},
    )
    assert _finetune_false_answers("{{ 'a' if finetune else tracker }}") == (1, {"tracker"})
    assert _finetune_false_answers("{% if not finetune %}b{% endif %}{{ device }}") == (1, set())

    root = Path(__file__).resolve().parent.parent / "templates"
    counted = 0
    for path in root.rglob("*.jinja"):
        branches, read = _finetune_false_answers(path.read_text(encoding="utf-8"))
        counted += branches
        # streaming: the twin whose resume check runs a false primary's lines shares its answer
        assert not read - {"streaming"}, (path, read)
    assert counted >= 20  # optim.py, train.py, resume_check.py, the checkpoints, the models...


def test_a_streaming_combination_is_checked_by_its_streaming_primary():
    """One streaming primary a task and distributed answer (tracker none, the CPU, fp32, no
    compile, no finetune, no accumulation) runs check all on shards it prepared; a streaming
    combination one answer away from it runs --help; the rest are rendered and linted. The
    streaming-false half plans as it did without the streaming half."""
    combos = matrix.combinations()
    plans = matrix.plans(combos)
    streaming = [(c, p) for c, p in zip(combos, plans, strict=True) if c["streaming"]]

    assert len(combos) == 6720 and len(streaming) == 3360
    assert collections.Counter(p.kind for _, p in streaming) == {
        "all": 15,
        "import": 140,
        "lint": 3205,
    }
    home = {"tracker": "none", "device": "cpu", "precision": "fp32", "compile": False}
    home.update({"finetune": False, "grad_accum_steps": 1})
    primaries = [c for c, p in streaming if p.which == "all"]
    assert all(c.items() >= home.items() for c in primaries)
    assert len({(c["task"], c["distributed"]) for c in primaries}) == 15
    for answers, plan in streaming:
        if plan.which == "all":
            assert (plan.primary, plan.then, plan.options) == (None, (), {})
            continue
        assert plan.primary == combination_id({**answers, **home})
        differs = {k for k, v in home.items() if answers[k] != v}
        assert plan.which == ("import" if len(differs) == 1 else "lint")
        assert matrix.family(answers) == matrix.family({**answers, **home})

    false = _streaming_false()
    alone = [p.kind for p in matrix.plans(false)]
    assert alone == [p.kind for c, p in zip(combos, plans, strict=True) if not c["streaming"]]


def test_a_streaming_slice_without_its_streaming_primary_checks_itself():
    """Without the streaming primary, nothing streams its task's shards: the streaming half
    follows the rules of the other half within the slice (every check on shards it prepared)."""
    for only in (["precision=bf16", "task=custom"], ["tracker=wandb", "task=image"]):
        kinds = {}
        for streaming in ("yes", "no"):
            combos = matrix.select(matrix.combinations(), [*only, f"streaming={streaming}"])
            kinds[streaming] = [p.kind for p in matrix.plans(combos)]
        assert kinds["yes"] == kinds["no"] and "all" in kinds["yes"]


def test_a_streaming_primary_prepares_shards_and_checks_on_them():
    """Its `prepare` writes the task's data as shards (generation's the corpus, tokenized), and
    every check of a streaming render reads them; a streaming-false render's are as before."""
    from scaffold.matrix import runner

    custom = {"task": "custom", "precision": "fp32", "streaming": True}
    assert runner.prepare_arguments(custom) == [
        "prepare", "--out", runner.SHARDS, "--shard-mb", "0.05", "--batch-size=8",
        "--val-fraction=0.01",
    ]  # fmt: skip
    assert "--image-size=16" in runner.prepare_arguments({**custom, "task": "image"})
    assert runner.check_sizes(custom)["data"] == runner.SHARDS
    generation = {**custom, "task": "generation"}
    assert runner.prepare_arguments(generation) == [
        "prepare", "--data", "corpus.jsonl", "--out", runner.SHARDS, "--shard-mb", "0.05",
        "--tokenizer", "char",
    ]  # fmt: skip
    assert runner.check_sizes(generation)["data"] == runner.SHARDS
    assert runner.prepare_arguments({**custom, "streaming": False}) is None
    assert "data" not in runner.check_sizes({**custom, "streaming": False})
    assert runner.prepare_arguments({**generation, "streaming": False})[-4:-2] == [
        "--out",
        runner.PREPARED,
    ]


# The answers a streaming primary leaves out: its streaming blocks must read none of them, so
# that the one primary of a task and distributed answer runs every streaming line they render.
NOT_IN_STREAMING_BLOCKS = {
    "tracker",
    "device",
    "precision",
    "compile",
    "finetune",
    "grad_accum_steps",
}


# Known exceptions, by file name: generation's streaming `prepare` takes a finetune render's
# published tokenizer (`tok = given or learn_tokenizer(...)`), which only a streaming finetune
# generation render has; the matrix imports it (its --help, one answer from the streaming
# primary) and no check runs it.
STREAMING_BLOCKS_READ = {'{% if task == "generation" %}prepare.py{% endif %}.jinja': {"finetune"}}


def test_the_streaming_blocks_read_no_answer_a_streaming_primary_leaves_out():
    root = Path(__file__).resolve().parent.parent / "templates"
    for path in root.rglob("*.jinja"):
        whole = "streaming" in str(path.relative_to(root))
        read = _block_answers(path.read_text(encoding="utf-8"), whole, answer="streaming")
        known = STREAMING_BLOCKS_READ.get(path.name, set())
        assert not read & NOT_IN_STREAMING_BLOCKS - known, (path, read & NOT_IN_STREAMING_BLOCKS)
