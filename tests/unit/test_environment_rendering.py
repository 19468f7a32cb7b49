"""Token-exact rendering with the tiny model's ChatML tokenizer: the sequence a trainer sees is the
prompt, sampled and observation tokens as given and produced, and it decodes to the template's own
rendering of the whole conversation."""

from __future__ import annotations

import pytest

from rlfleet.services.environment.rendering import ChatRenderer, TemplateNotPrefixStable

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
PROMPT = [{"role": "system", "content": "you add numbers"}, {"role": "user", "content": "what is 2 plus 3 ?"}]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir) -> ChatRenderer:
    return ChatRenderer.from_pretrained(str(tiny_model_dir))


def sample(renderer: ChatRenderer, text: str, *, eos: bool) -> list[int]:
    """What a model would have sampled: ``text``'s tokens, then the end-of-turn token if it stopped."""
    ids = renderer.encode(text)
    return ids + [renderer.tokenizer.eos_token_id] if eos else ids


def test_three_turns_concatenate_to_the_templates_rendering(renderer):
    turns = [  # (what the model writes, whether it sampled EOS, the environment's answer)
        ("the answer is five", True, [{"role": "tool", "name": "python", "content": "5"}]),
        ("two plus three equals", False, [{"role": "user", "content": "please finish"}]),  # cut by length
        ("five", True, []),
    ]
    messages = list(PROMPT)
    prompt_text, prompt_ids = renderer.prompt(messages, TOOLS)
    assert prompt_text == renderer.render(PROMPT, TOOLS)
    assert prompt_ids == renderer.encode(prompt_text)
    sequence = list(prompt_ids)
    for index, (text, eos, observation) in enumerate(turns):
        sampled = sample(renderer, text, eos=eos)
        result = renderer.observation(messages, sampled, observation, TOOLS)
        assert result.assistant_message == {"role": "assistant", "content": text}  # EOS stripped
        before = renderer.render(messages, TOOLS) + renderer.decode(sampled)
        messages += [result.assistant_message, *observation]
        full = renderer.render(messages, TOOLS)
        assert result.text == full[len(before):]
        assert result.token_ids == renderer.encode(result.text)
        sequence += sampled
        if index < len(turns) - 1:  # the last turn ends the episode: nothing follows it
            sequence += result.token_ids
            assert renderer.decode(sequence) == full
    # The whole episode: prompt + turn 1 + obs 1 + turn 2 + obs 2 + turn 3, as rendered by the template.
    assert renderer.decode(sequence) == renderer.render(messages[:-1], TOOLS) + "five<|im_end|>"


def test_observation_text_after_an_eos_and_after_a_length_cut(renderer):
    tool = [{"role": "tool", "content": "5"}]
    after_eos = renderer.observation(PROMPT, sample(renderer, "five", eos=True), tool)
    assert after_eos.text == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    after_cut = renderer.observation(PROMPT, sample(renderer, "five", eos=False), tool)
    assert after_cut.text == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.decode(after_cut.token_ids) == after_cut.text


def test_a_template_that_rewrites_past_turns_is_refused(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # Like templates that drop a past turn's reasoning: the assistant's content is re-rendered trimmed.
    tokenizer.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | trim")
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(TemplateNotPrefixStable, match="not prefix-stable"):
        renderer.observation(PROMPT, sample(renderer, "five ", eos=False), [])
