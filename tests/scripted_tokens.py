"""A policy whose turns are scripted at the token level: trace's `Policy` (its rendering, parsing and loops) with
`generate_ids` replaced, so every path that decodes through it (evaluation, training, calibration) sees the
same turns."""

from __future__ import annotations

import re

from trace_lib.engine.policy import Policy


class ScriptedPolicy(Policy):
    """Per row: key k with k % 3 == 0 -> looks the value up forever; else looks it up once, then
    answers (right on even batch rows, wrong on odd ones)."""

    seen: list[list[list[int]]]
    """The prompts of every call (set by tests that look at what the agent read)."""

    def generate_ids(self, prompts, *, temperature, top_p, max_new_tokens, seed, processor=None, use_prefix_cache=None,
                     sessions=None):
        if hasattr(self, "seen"):
            self.seen.append(prompts)
        outs = []
        for row, ids in enumerate(prompts):
            text = self.tokenizer.decode(ids)
            key = re.search(r"value of (k\d+)", text).group(1)
            turns = text.count("<|im_start|>assistant") - 1
            if int(key[1:]) % 3 == 0 or turns == 0:
                reply = f'<tool_call>\n{{"name": "get_value", "arguments": {{"key": "{key}"}}}}\n</tool_call>'
            else:
                value = int(key[1:]) * 10 + (row % 2)
                reply = f"The value is {value}."
            outs.append(self.encode(reply + "<|im_end|>"))
        return outs, ["stop"] * len(prompts)

    def play_turns(self, prompts, next_turn, *, temperature, top_p, max_new_tokens, seed, sessions, processor=None):
        """Turn by turn through the scripted `generate_ids`, the live rows in order as a batch; no time is
        spent outside decoding."""
        prompts, live = list(prompts), list(range(len(prompts)))
        while live:
            outs, finish = self.generate_ids([prompts[r] for r in live], temperature=temperature, top_p=top_p,
                                             max_new_tokens=max_new_tokens, seed=seed)
            going = []
            for r, toks, why in zip(live, outs, finish, strict=True):
                nxt = next_turn(r, toks, why)
                if nxt is not None:
                    prompts[r] = nxt[0]
                    going.append(r)
            live = going
        return 0.0
