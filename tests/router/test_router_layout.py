"""Feature version 3's layout-free prompt form (tokenyard/router_models/runtime/layout.py): one
request written in several layouts reads the same; the input is found wherever it sits."""
import pytest

from tokenyard.router_models.runtime.layout import canonical, stem


def test_stem_strips_one_suffix_and_keeps_three_letters():
    assert [stem(w) for w in ("letters", "sorting", "numbers", "capitalised", "is", "sum", "ordered", "write")] == \
        ["letter", "sort", "number", "capital", "is", "sum", "order", "writ"]


@pytest.mark.parametrize("text", [
    "Uppercase these words: lamp tree rock",
    "lamp tree rock - uppercase these words",
    "could you uppercase these words? lamp tree rock",
    "Good evening. Uppercase these words: lamp tree rock",
    "UPPERCASE THESE WORDS:\nlamp tree rock",
])
def test_one_request_in_several_layouts_has_one_form(text):
    # payload after " : " whatever the layout; stop words, case, punctuation, lines gone
    assert canonical(text).endswith(" : lamp tree rock")
    assert canonical(text).split(" : ")[0].split()[-2:] == ["uppercas", "word"]


def test_a_noun_before_a_list_joins_the_input_run():
    # no grammar is parsed: the stated limitation of the run rule
    assert canonical("uppercase the words lamp tree rock") == "uppercas : words lamp tree rock"


def test_numbers_are_the_payload_wherever_they_are():
    assert canonical("Please add 12 and 30 for me.") == "add : 12 30"
    assert canonical("12 and 30: add them") == "add : 12 30"


def test_single_letters_are_data_and_names_stay_capitalised():
    assert canonical("How many b are in: a b c b").endswith(" : a b c b")
    form = canonical("Where is Tomas Verde based?")
    assert "Tomas" in form and "Verde" in form and " : " not in form


def test_the_sentence_holding_the_input_is_read_and_other_sentences_are_not():
    with_context = canonical("My cat is asleep on the sofa today. Sort ascending: 5 3 9. Have a nice evening.")
    assert with_context == canonical("Sort ascending: 5 3 9") == "sort ascend : 5 3 9"


def test_empty_and_punctuation_only_text():
    assert canonical("") == ""
    assert canonical("?!.\n") == ""
