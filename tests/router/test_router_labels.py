"""Label generation without engines: split construction and the labelling rule."""
from collections import Counter

from tokenyard.demo import task_suite
from tokenyard.demo.router_labels import draw_items, half_of, input_key, label_rows


def test_splits_are_uniform_disjoint_and_hold_out_phrasing_3():
    items = draw_items({"train": 96, "calibration": 64, "test": 64}, seed=3)
    for name, its in items.items():
        cells = Counter((it.task, it.level) for it in its)
        assert len(cells) == 32 and set(cells.values()) <= {len(its) // 32, len(its) // 32 + 1}
    assert all(it.phrasing != task_suite.HELD_OUT_PHRASING for it in items["train"])
    assert all(it.split == "validation" for it in items["train"] + items["calibration"])
    assert {half_of(it) for it in items["train"]} == {"train"}
    assert {half_of(it) for it in items["calibration"]} == {"calibration"}
    assert not {input_key(it) for it in items["train"]} & {input_key(it) for it in items["calibration"]}
    assert draw_items({"train": 96}, seed=3)["train"] == items["train"]   # deterministic


def test_input_key_ignores_wording():
    a = task_suite.TaskItem("add", 2, 0, ({"role": "user", "content": "What is 12 + 30?"},), "42", "test")
    b = task_suite.TaskItem("add", 2, 3, ({"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What do you get if you add 12 to 30?"}),
                            "42", "test")
    assert input_key(a) == input_key(b)


def test_label_is_one_when_small_is_as_good_as_large():
    item = task_suite.TaskItem("add", 1, 0, ({"role": "user", "content": "What is 1 + 2?"},), "3", "test")
    rows = label_rows("test", [item] * 4, ["3", "3", "4", "4"], ["3", "5", "3", "5"], [9] * 4)
    assert [r["label"] for r in rows] == [1, 1, 0, 1]
    assert rows[0]["prompt"] == "What is 1 + 2?" and rows[0]["prompt_tokens"] == 9


def test_test_split_rewords_phrasing_3_in_the_router_only_wording():
    items = draw_items({"test": 256}, seed=3)["test"]
    phrasings = {it.phrasing for it in items}
    assert task_suite.HELD_OUT_PHRASING not in phrasings
    assert set(task_suite.ROUTER_TEST_PHRASINGS) <= phrasings and {0, 1, 2} <= phrasings
    for it in items:
        if it.phrasing in task_suite.ROUTER_TEST_PHRASINGS:
            back = task_suite.rephrase(it, task_suite.HELD_OUT_PHRASING)
            assert back.messages[-1]["content"] != it.messages[-1]["content"] and it.check(it.answer)
            assert input_key(back) == input_key(it)
    drawn = task_suite.generate_items("test", 2_000, 5) + task_suite.generate_items("validation", 2_000, 5)
    assert not {it.phrasing for it in drawn} & set(task_suite.ROUTER_TEST_PHRASINGS)


def test_router_only_wording_never_reaches_the_tokenizer_corpus():
    blob = "\n".join(task_suite.corpus_texts(640, seed=0))
    for task in task_suite.TASKS:
        for templates in task_suite.get_task(task).templates.values():
            for phrasing in task_suite.ROUTER_TEST_PHRASINGS:
                fixed = max(templates[phrasing].split("{"), key=len).split("}")[-1].strip(" :?.")
                assert fixed and fixed not in blob, fixed
