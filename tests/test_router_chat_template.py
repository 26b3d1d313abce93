"""vLLM's chat_template_kwargs and documents: more variables for the model's chat template, seen
through /tokenize and a chat completion's usage against fake workers."""

from __future__ import annotations

import pytest
from router_fakes import model_text, router_with_a_pair
from tiny_models import default_model_with_template

# ChatML, as the default model's, with three variables a request may set: documents (after the
# messages), enable_thinking (an empty think block opens the answer when it is false), and tags
# (iterated, so a number there is a template error).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>\n{% endfor %}"
    "{% for t in tags or [] %}#{{ t }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is in the box?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The default model's config and tokenizer, its chat template replaced by TEMPLATE."""
    folder = tmp_path_factory.mktemp("templated") / "templated"
    return default_model_with_template(folder, TEMPLATE)


@pytest.fixture(scope="module")
def router(model):
    with router_with_a_pair(model) as router:
        yield router


def rendered(router, model, **fields) -> str:
    """The conversation as /tokenize renders it with ``fields``, decoded back to text."""
    with router.client() as h:
        r = h.post("/tokenize", json={"model": model.name, "messages": MESSAGES, **fields})
        assert r.status_code == 200, r.text
    return model_text(model).decode(r.json()["tokens"], skip_special_tokens=False)


def test_template_variables_and_documents_reach_the_template(router, model):
    plain = rendered(router, model)
    assert plain.endswith("<|im_start|>assistant\n") and "<think>" not in plain
    thinking_off = rendered(router, model, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off == plain + "<think></think>\n"
    documents = [{"title": "Box", "text": "a cat"}]
    grounded = rendered(router, model, documents=documents, chat_template_kwargs={"tags": ["x"]})
    assert "<doc>Box: a cat</doc>\n#x<|im_start|>assistant\n" in grounded
    # A chat completion renders its prompt the same way: its prompt grows by the think block.
    with router.client() as h:
        body = {"model": model.name, "messages": MESSAGES, "max_tokens": 2}
        usage = [
            h.post("/v1/chat/completions", json=body | extra).json()["usage"]["prompt_tokens"]
            for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})
        ]
    think = model_text(model).encode("<think></think>\n", add_special_tokens=False)
    assert usage[1] - usage[0] == len(think)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
        ({"chat_template_kwargs": {"messages": [], "documents": []}}, "documents, messages"),
        ({"chat_template_kwargs": {"tags": 5}}, "cannot render"),  # iterating a number
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"documents": [{"title": 5}]}, "documents"),
    ],
    ids=["renderer-argument", "template-input", "template-error", "not-a-map", "bad-document"],
)
def test_template_arguments_that_cannot_be_honoured_are_a_400(router, model, fields, words):
    for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 2})):
        with router.client() as h:
            body = {"model": model.name, "messages": MESSAGES, **fields, **extra}
            r = h.post(path, json=body)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"], r.text
