"""Tools: what a multi-turn policy can call between its turns, and the tokens a call inserts.

Read it after grpo.py's roll_out: rollout.sample_turns samples a turn, asks a ToolEnvironment
whether the turn calls a tool, and if so appends the tool's answer and samples the next turn. The
policy's own tokens are its actions; what this file inserts (the tool's output and the chat
template's tokens around it) is context, trained on by no term (grpo.py's response_mask is 0
there). Its sections:

    1. the tools        calculator (exact arithmetic: a parser, never `eval`), lookup (a table the
                        prompt does not hold: tasks.lookup_table)
    2. the call syntax  parse_call, two syntaxes: "chat", a <tool_call> JSON object as SmolLM2's
                        and Qwen2.5's chat templates describe (Hermes' format), and "tags",
                        "(name argument)" for the tiny model's character vocabulary
    3. one call         ToolEnvironment.respond: the tool output of one model turn as text, every
                        failure (a malformed call, an unknown tool, bad arguments, a tool that
                        raises or runs past --tool-timeout) an error message, never an exception;
                        either cut to --max-tool-response-length tokens
    4. the template     ToolEnvironment.suffix_ids: the tokens inserted after a model turn, the
                        tool message and the next generation prompt, rendered by the chat template
                        once and tokenised once (token in, token out: no sampled token is ever
                        decoded and encoded again)
    5. the flags        ToolArgs (--tools, --max-assistant-turns, ...), check_tool_args

Where a response's tokens come from is in its model mask: 1 for a sampled token, 0 for an inserted
one (verl's agent loop: response_mask; TRL: tool_mask). final_turn gives the reward the text of the
model's last turn only, so a tool's output never scores for the policy.
"""

import fractions
import json
import re
import threading
from dataclasses import dataclass
from typing import Callable

import harness
import tasks

# --------------------------------------------------------------------------------------------------
# 1. The tools. Each takes one string argument and returns its output as text; it may raise (the
# environment turns that into an error message).
# --------------------------------------------------------------------------------------------------


@dataclass
class Tool:
    """A tool the policy can call: its name, its one argument's name (the chat syntax's
    "arguments" key) and the function computing its output."""

    name: str
    argument: str
    run: Callable[[str], str]
    description: str


def calculator(expression):
    """The exact value of an arithmetic expression (numbers, + - * / and parentheses), as an
    integer or a reduced fraction ("7", "-5/3"): tasks.evaluate_arithmetic's parser with
    fractions.Fraction instead of float, so 0.1 + 0.2 is 3/10. Raises ValueError on anything the
    parser refuses (syntax, other characters, division by zero, its size limits)."""
    value = tasks.evaluate_arithmetic(expression, number=fractions.Fraction)
    if value is None:
        raise ValueError(f"cannot evaluate {expression!r}")
    return str(value)


def make_lookup(table):
    """A lookup tool over `table` (key -> value): the value of a known key; KeyError otherwise."""

    def lookup(key):
        key = key.strip()
        if key not in table:
            raise KeyError(f"no entry {key!r}")
        return table[key]

    return lookup


def make_tools(names):
    """The Tool of each name in `names` (TOOL_NAMES)."""
    available = {
        "calculator": Tool("calculator", "expression", calculator, "evaluates + - * / ( ) exactly"),
        "lookup": Tool(
            "lookup", "key", make_lookup(tasks.lookup_table()), "the value stored under a key"
        ),
    }
    return {name: available[name] for name in names}


TOOL_NAMES = ("calculator", "lookup")
# --tool-history-mismatch: what the engine's history between turns leaves out (ToolEnvironment)
HISTORY_MISMATCHES = ("none", "drop_separator")

# --------------------------------------------------------------------------------------------------
# 2. The call syntax
# --------------------------------------------------------------------------------------------------

# Hermes' format, which SmolLM2-Instruct and Qwen2.5 are trained on: a JSON object (or a one-element
# list of them) with "name" and "arguments" between the tags
CHAT_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
CHAT_CALL_OPEN = "<tool_call>"
# the tiny model's: "(name argument)", e.g. "(lookup abcd)"; the argument runs to the turn's last
# ")", so it may hold parentheses: "(calculator 2*(3+4))"
TAG_CALL = re.compile(r"\(([a-z]+) (.*)\)", re.DOTALL)
TAG_CALL_OPEN = "("


class CallError(Exception):
    """A turn that tries to call a tool and fails to say which, or with what."""


def parse_call(text, syntax):
    """The first tool call of a model turn's text as (name, arguments: dict), or None when the turn
    calls nothing (it is the final answer). A turn that opens a call and does not complete one
    (no closing tag, broken JSON, no name) raises CallError. Never anything else: the text is
    the policy's, anything may be in it."""
    if syntax == "chat":
        if CHAT_CALL_OPEN not in text:
            return None
        match = CHAT_CALL.search(text)
        if match is None:
            raise CallError("a <tool_call> without its </tool_call>")
        try:
            call = json.loads(match.group(1))
        except (ValueError, RecursionError):
            raise CallError("the tool call is not valid JSON") from None
        if isinstance(call, list) and len(call) == 1:
            call = call[0]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise CallError('the tool call has no "name"')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise CallError('the tool call\'s "arguments" is not valid JSON') from None
        if not isinstance(arguments, dict):
            raise CallError('the tool call\'s "arguments" is not an object')
        return call["name"], arguments
    if TAG_CALL_OPEN not in text:
        return None
    match = TAG_CALL.search(text)
    if match is None:
        raise CallError("expected (name argument)")
    return match.group(1), {None: match.group(2)}


# --------------------------------------------------------------------------------------------------
# 3-4. One call, and the tokens it inserts
# --------------------------------------------------------------------------------------------------

# The tiny tokenizer's chat template (it has none): a user message is its text, an assistant
# message its text and EOS, a tool message "#", its text and a newline; no generation prompt. So
# "abcd=" "(lookup abcd)[EOS]" "#bca\n" "bca[EOS]" is one conversation.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] }}[EOS]"
    "{%- elif message['role'] == 'tool' -%}#{{ message['content'] }}{{ '\\n' }}"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)


class ToolEnvironment:
    """The tools of a run and how their outputs enter the context.

    tokenizer       the policy's; its chat template renders the tool messages (the tiny
                    tokenizer's: TINY_CHAT_TEMPLATE)
    tools           name -> Tool (make_tools)
    syntax          "chat" or "tags" (parse_call)
    max_output_tokens  a tool output longer than this many tokens is cut to them, and
                    TRUNCATED_MARK appended (verl's max_tool_response_length cuts characters)
    timeout         seconds a call may run; past it the output is an error message (the call's
                    thread is left to finish on its own: a Python thread cannot be killed, so a
                    tool must end by itself, as both of this file's do)
    history_mismatch  "none", or the lab's "drop_separator" (sampler_ids)
    """

    TRUNCATED_MARK = "...(truncated)"

    def __init__(
        self, tokenizer, tools, syntax, max_output_tokens, timeout, history_mismatch="none"
    ):
        self.tokenizer = tokenizer
        self.tools = tools
        self.syntax = syntax
        self.max_output_tokens = max_output_tokens
        self.timeout = timeout
        self.history_mismatch = history_mismatch
        self.chat_template = tokenizer.chat_template or TINY_CHAT_TEMPLATE

    def respond(self, turn_text):
        """(output text, failed) for a model turn that calls a tool, None for one that does not.
        The documented outputs of a failure, word for word:

            a malformed call    "error: malformed tool call: <what is wrong>"
            an unknown tool     "error: unknown tool '<name>' (tools: <names>)"
            bad arguments       "error: <tool> takes one argument, '<argument>'"
            the tool raises     "error: <tool> failed: <ExceptionType>: <message>"
            past the timeout    "error: <tool> did not finish in <timeout> s"
        """
        try:
            call = parse_call(turn_text, self.syntax)
        except CallError as e:
            return f"error: malformed tool call: {e}", True
        if call is None:
            return None
        name, arguments = call
        if name not in self.tools:
            return f"error: unknown tool {name!r} (tools: {', '.join(self.tools)})", True
        tool = self.tools[name]
        if self.syntax == "tags":
            arguments = {tool.argument: arguments[None]}
        if set(arguments) != {tool.argument} or not isinstance(arguments[tool.argument], str):
            return f"error: {name} takes one argument, {tool.argument!r}", True
        output, failed = self._run(tool, arguments[tool.argument])
        return self._cut(output), failed

    def _run(self, tool, argument):
        """(output, failed) of one call in its own thread, waited for at most self.timeout s."""
        result = {}

        def call():
            try:
                result["output"] = str(tool.run(argument))
            except Exception as e:  # the tool's failure is the policy's observation
                result["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            return f"error: {tool.name} did not finish in {self.timeout:g} s", True
        if "error" in result:
            return f"error: {tool.name} failed: {result['error']}", True
        return result["output"], False

    def _cut(self, output):
        """The output within max_output_tokens tokens (then TRUNCATED_MARK appended)."""
        ids = self.tokenizer.encode(output, add_special_tokens=False)
        if len(ids) <= self.max_output_tokens:
            return output
        return self.tokenizer.decode(ids[: self.max_output_tokens]) + self.TRUNCATED_MARK

    def render(self, messages, add_generation_prompt):
        """The chat template's text of `messages`."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def sampler_ids(self, suffix):
        """The inserted tokens as the engine's history holds them: `suffix` itself (token in,
        token out), or, for the mismatch lab's drop_separator, without its first token: the
        history the engine continues from then differs from the one the trainer scores (verl
        #6921: the newline after the assistant's <|im_end|> was missing on one side, "a
        train/inference token mismatch that compounds each turn")."""
        if self.history_mismatch == "drop_separator":
            return suffix[1:]
        return suffix

    def suffix_ids(self, output):
        """The token ids inserted after a model turn that ended with EOS and called a tool: what
        the chat template writes after the assistant's EOS (SmolLM2's: the newline that closes the
        turn; verl #6921 was this separator dropped), the tool message with `output`, and the next
        generation prompt. Rendered as the difference of two renderings of a stand-in conversation
        (verl's and TRL's way: the template is applied to messages, never to the sampled text),
        tokenised once."""
        conversation = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        before = self.render(conversation, add_generation_prompt=False)
        after = self.render(
            conversation + [{"role": "tool", "content": output}], add_generation_prompt=True
        )
        eos = self.tokenizer.eos_token
        # the model's own turn ends at its EOS: what the template writes after it is inserted
        end_of_turn = before.rindex(eos) + len(eos)
        if not after.startswith(before[:end_of_turn]):
            raise harness.RunError(
                "the chat template renders the conversation before a tool message differently "
                "once the tool message is added: the tokens between turns cannot be computed"
            )
        return self.tokenizer.encode(after[end_of_turn:], add_special_tokens=False)


def final_turn(response_ids, model_mask):
    """The token ids of the model's last turn: the sampled tokens after the last inserted one (what
    the reward reads: the policy's answer, never a tool's output)."""
    last_inserted = max((i for i, m in enumerate(model_mask) if not m), default=-1)
    return response_ids[last_inserted + 1 :]


def tool_metrics(tool_calls, tool_failures, model_masks):
    """Per-step tool metrics over a batch (means over responses): verl's num_turns/* (the turns of
    the model and of the tools in a response) and TRL's tools/call_frequency (calls per response)
    and tools/failure_frequency (the share of calls that ended in an error message), and the
    tokens of each kind."""
    B = len(model_masks)
    model_turns = [
        sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        for mask in model_masks
    ]
    turns = [model + calls for model, calls in zip(model_turns, tool_calls)]
    calls = sum(tool_calls)
    return {
        "num_turns/mean": sum(turns) / B,
        "num_turns/max": max(turns),
        "num_turns/min": min(turns),
        "tools/call_frequency": calls / B,
        "tools/failure_frequency": sum(tool_failures) / max(calls, 1),
        "response_length/model_tokens_mean": sum(sum(m) for m in model_masks) / B,
        "response_length/tool_tokens_mean": sum(len(m) - sum(m) for m in model_masks) / B,
    }


# --------------------------------------------------------------------------------------------------
# 5. The flags
# --------------------------------------------------------------------------------------------------


@dataclass
class ToolArgs:
    """Multi-turn tool use (rollout.sample_turns reads them), flat on grpo.py's command line."""

    tools: tuple[str, ...] = ()
    """Tools the policy may call between turns (calculator, lookup); none: one turn per
    response. The call syntax: <tool_call> JSON with --use-chat-template, else (name argument)."""
    max_assistant_turns: int = 4
    """--tools: model turns per response at most (verl's multi_turn.max_assistant_turns); a
    response whose last allowed turn calls a tool ends there (finish reason max_turns)."""
    max_tool_response_length: int = 64
    """--tools: a tool output over this many tokens is cut to them (verl's
    multi_turn.max_tool_response_length)."""
    tool_timeout: float = 5.0
    """--tools: seconds one call may run before its output is an error message."""
    tool_history_mismatch: str = "none"
    """The mismatch lab's tokenisation arm: none (token in, token out), or drop_separator: the
    engine samples each next turn from a history without the first token the template inserts
    after a turn (verl #6921's dropped separator), while the trainer trains on the template's."""


def check_tool_args(args):
    """The tool flags alone, each refused in one line: known tools, positive limits."""
    unknown = [name for name in args.tools if name not in TOOL_NAMES]
    if unknown:
        raise ValueError(f"--tools: unknown tool {unknown[0]!r} (tools: {', '.join(TOOL_NAMES)})")
    ranges = {
        ">= 1": "max_assistant_turns max_tool_response_length",
        "> 0": "tool_timeout",
    }
    harness.check_rules(args, {"tool_history_mismatch": HISTORY_MISMATCHES}, ranges)
    if args.tool_history_mismatch != "none" and not args.tools:
        harness.refuse(args, "tool_history_mismatch", "none without --tools")
