"""Multi-turn contexts with a chat template: the ids the trainer trains on are the ids the
engine saw, with no re-tokenisation drift across a tool turn (docs/design/prompt-data.md#prompt-data)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from replayrl.rollout.engines.base import Generation
from replayrl.rollout.episodes.env_sessions import EnvSessions
from replayrl.rollout.episodes.turn_loop import assemble, run_episodes
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.text.tokenizer import load_tokenizer

VOCAB = {"a": 0, "b": 1, "ab": 2, "[": 3, "]": 4, "=": 5, "<eos>": 6}
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}[{{ m['content'] }}]"
            "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A BPE tokenizer that merges "a" "b" into "ab" and decodes by concatenation, so the text
    of the engine's separate tokens [a, b] re-tokenises to the one token [ab]."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=VOCAB, merges=[("a", "b")]))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = TEMPLATE
    d = tmp_path_factory.mktemp("bpe")
    fast.save_pretrained(str(d))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": VOCAB["<eos>"]}))
    return d


class EchoEnv:
    """A turn starting with "a" is a tool call; the observation is the one token "a"."""

    def observe(self, prompt_ids, turn_ids):
        return np.array([VOCAB["a"]], np.int32) if int(turn_ids[0]) == VOCAB["a"] else None


def _gen(ids, finish):
    return Generation(response_ids=np.array(ids, np.int32),
                      rollout_logprobs=np.full(len(ids), -0.5, np.float32),
                      finish_reason=finish, sample_support=None, routed_experts=None,
                      indexer_topk=None)


async def test_the_next_turn_appends_the_rendered_observation_to_the_exact_ids(bpe_dir):
    tok = load_tokenizer(bpe_dir, apply_chat_template=True)
    prompt = tok.encode_prompt("b")  # "b" + generation prompt "="
    assert prompt.tolist() == [VOCAB["b"], VOCAB["="]]
    seen: list[list[int]] = []
    turns = iter([_gen([VOCAB["a"], VOCAB["b"]], "stop"), _gen([VOCAB["b"], VOCAB["<eos>"]], "stop")])

    async def generate_turn(contexts, seed):
        seen.append(list(contexts[0]))
        return [next(turns)], 0

    (episode,) = await run_episodes(generate_turn, [prompt], max_turns=2, max_new_tokens=2,
                                    max_positions=64, seed=0,
                                    env=EnvSessions.of_task(EchoEnv(), [Prompt(0, prompt, -1)],
                                                            tokenizer=tok))
    # the tool turn as the template renders it after an assistant turn: "[a]" then "="
    delta = [VOCAB["["], VOCAB["a"], VOCAB["]"], VOCAB["="]]
    exact = [VOCAB["b"], VOCAB["="], VOCAB["a"], VOCAB["b"], *delta]
    assert seen[1] == exact
    # what re-tokenising the conversation's text would give instead: "b=ab[a]=" with [ab]
    retokenised = tok.tokenizer(tok.tokenizer.decode(exact), add_special_tokens=False)["input_ids"]
    assert retokenised == [VOCAB["b"], VOCAB["="], VOCAB["ab"], *delta] != exact
    # the trajectory the trainer gets: exactly the engine's context plus its last turn
    merged, _ = assemble(episode, sample_id=0, require=())
    f = merged.sample_fields()
    assert list(episode.prompt_ids) + f["response_ids"].tolist() == exact + [VOCAB["b"], VOCAB["<eos>"]]
    assert f["loss_mask"].tolist() == [1, 1, 0, 0, 0, 0, 1, 1]


def test_without_the_template_the_environment_ids_are_appended_unchanged(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert tok.render_observation(np.array([VOCAB["a"], VOCAB["b"]]), [VOCAB["a"]]).tolist() == [0, 1]
    with pytest.raises(Exception, match="needs --apply-chat-template"):
        tok.encode_prompt([{"role": "user", "content": "b"}])
