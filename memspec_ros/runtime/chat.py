"""Prompt construction for a Generate goal, in one place: prompt text or chat messages -> token ids.

    ids = prompt_ids(tokenizer, prompt, messages, raw=False, system_prompt="")

* ``raw``: ``prompt`` is tokenized as is (plain continuation); ``messages`` must be empty.
* The tokenizer has a chat template (an instruct model): the conversation is ``messages``, or one
  user turn holding ``prompt``; a system turn with ``system_prompt`` goes first when that is not
  empty and the conversation does not start with a system message of its own (empty: the template's own default,
  if it has one). It is rendered with ``apply_chat_template(add_generation_prompt=True)``, so the
  model answers as the assistant.
* No chat template: ``prompt`` is tokenized as is, and a goal with ``messages`` is refused.
* With a chat template, the special-token strings a message (or the prompt as the user turn) holds
  (``<|im_end|>``, ``<|im_start|>``, ``<filename>``, ...) are tokenized as the ordinary text they spell
  (transformers' ``sanitize_control_tokens``): only the template itself writes control ids, so content can
  neither close its own turn nor open a system turn of its own. Content holding none gets
  exactly apply_chat_template's ids. (Such content used to be refused, which also refused a conversation
  for good once the model's own answer, re-sent as the assistant turn, spelled one out.) Raw goals and
  models without a template keep special strings as control ids: there the sender writes the whole text
  and no turn structure or system prompt is imposed, so there is nothing to forge (an expert may write
  ChatML by hand).

Templates come from model files and are rendered only through transformers' ``apply_chat_template``,
which runs Jinja in an ImmutableSandboxedEnvironment: a template that reaches for Python internals
raises (jinja2's SecurityError), which becomes a :class:`ChatTemplateError` with the reason.

:func:`end_token_ids` gives the ids that end a generation (the tokenizer's eos token and the
model's ``generation_config.eos_token_id``, where instruct models list their end-of-turn token).

No ROS here: the node calls :func:`check_request` in its goal callback (cheap, no tokenizer work)
and then :func:`prompt_ids`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
ROLES = (SYSTEM, USER, ASSISTANT)


class ChatError(ValueError):
    """The goal's prompt / messages / raw cannot make a prompt; the message says why and what to send."""


class ChatTemplateError(ChatError):
    """The model's chat template failed to render (template error, or sandbox refusal)."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_request(prompt: str, messages: Sequence[tuple[str, str]], raw: bool, templated: bool) -> str:
    """'' when the request is well formed, else the reason (roles, emptiness, raw with messages,
    messages without a chat template). No tokenizer work: cheap enough for a goal callback."""
    if raw:
        if messages:
            return ("raw is set but messages are given: a raw goal continues `prompt` as plain text;"
                    " send raw with a prompt only, or messages without raw")
        return _prompt_error(prompt, "the prompt is empty (raw goals continue `prompt`): set prompt")
    if not messages:
        return _prompt_error(prompt, "the prompt is empty and there are no messages: set prompt or messages")
    if prompt:
        return ("both prompt and messages are set: send the conversation in messages (the last one a user turn),"
                " or a single user turn in prompt")
    if not templated:
        return ("the model has no chat template (its tokenizer defines none), so messages cannot be rendered:"
                " send the text in prompt instead (plain continuation)")
    for i, (role, content) in enumerate(messages):
        if role not in ROLES:  # its first characters only: a client's megabyte of role went into the log and, as
            # the node's last rejection, onto every /diagnostics message
            shown = repr(role[:40]) + (f" ({len(role)} characters)" if len(role) > 40 else "")
            return f"messages[{i}] has unknown role {shown}: use one of {', '.join(ROLES)}"
        if not content:
            return f"messages[{i}] ({role}) has empty content"
        if content.isspace():
            return f"messages[{i}] ({role}) has only whitespace: give it some text"
        if role == SYSTEM and i > 0:
            # kept, it made two system turns (after generation.system_prompt, or the template's own default system
            # turn, put first): contradictory instructions the model weighs as it will, and templates that allow
            # one system turn (Gemma, Mistral) failed with their own error
            return (f"messages[{i}] is a system message: only the first message may be one; move it to"
                    " messages[0] (merged with a system message there), where it replaces generation.system_prompt"
                    " for this goal unless the node's generation.system_prompt_fixed rejects it")
    last = messages[-1][0]
    if last != USER:
        return (f"the last message is from the {last}, not the user: end the conversation with the user turn"
                " the model should answer")
    return ""


def _prompt_error(prompt: str, empty: str) -> str:
    if not prompt:
        return empty
    return "the prompt is only whitespace: give it some text" if prompt.isspace() else ""


def max_token_chars(tokenizer) -> int:
    """The most characters of input text that one token can stand for: the longest vocabulary entry
    (added and special tokens included), at least 1.

    A text of n characters therefore needs at least n / max_token_chars tokens, and one longer than
    ``limit * max_token_chars`` characters can never fit in ``limit`` tokens: the goal callback rejects
    it on its length alone, before any tokenization. For byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen)
    an entry spells its bytes one character per byte and a text has at least as many bytes as
    characters, so the bound holds exactly; likewise for byte-fallback SentencePiece (Llama 2). It
    assumes the tokenizer keeps every input character: a normalizer that folds characters together (NFC
    composing a letter and its accents, whitespace folding), unknown characters merged into one token, or
    a chat template that trims the content could in principle let a longer text fit. The bundled
    tokenizers have none of these."""
    vocab = tokenizer.get_vocab()
    return max(1, max((len(entry) for entry in vocab), default=1))


def conversation(prompt: str, messages: Sequence[tuple[str, str]], system_prompt: str = "") -> list[dict[str, str]]:
    """The turns given to the template: ``messages`` (or one user turn with ``prompt``), after a
    system turn with ``system_prompt`` when that is set and the conversation does not open with a system message
    (check_request refuses one further on)."""
    turns = [{"role": role, "content": content} for role, content in messages] or [{"role": USER, "content": prompt}]
    if system_prompt and turns[0]["role"] != SYSTEM:
        turns.insert(0, {"role": SYSTEM, "content": system_prompt})
    return turns


def system_prompt_applies(tokenizer, messages: Sequence[tuple[str, str]], raw: bool, system_prompt: str) -> bool:
    """Whether conversation() puts ``system_prompt`` first in this request (what prompt_ids renders)."""
    return bool(system_prompt) and not raw and has_chat_template(tokenizer) and (
        not messages or str(messages[0][0]) != SYSTEM)


def prompt_ids(tokenizer, prompt: str, messages: Sequence[tuple[str, str]] = (), raw: bool = False,
               system_prompt: str = "") -> list[int]:
    """The token ids to generate from (see the module docstring). Raises ChatError (ChatTemplateError
    when the template itself fails) with the reason."""
    messages = [(str(role), str(content)) for role, content in messages]
    templated = has_chat_template(tokenizer)
    reason = check_request(prompt, messages, raw, templated)
    if reason:
        raise ChatError(reason)
    if raw or not templated:
        return raw_ids(tokenizer, prompt)
    turns = conversation(prompt, messages, system_prompt)
    ids = _rendered(tokenizer, turns)
    if not ids:
        raise ChatTemplateError("the model's chat template rendered the conversation as no tokens at all")
    names = [f"messages[{i}] ({role})" for i, (role, _) in enumerate(messages)] or ["the prompt"]
    if len(turns) > len(names):  # conversation() put the system prompt first
        names.insert(0, "generation.system_prompt")
    reason = _forged_control(tokenizer, turns, ids, names)
    if reason:
        raise ChatError(reason)
    return ids


def raw_ids(tokenizer, prompt: str) -> list[int]:
    """``prompt`` as plain text with the tokenizer's own special tokens (a Llama's BOS), but one BOS only: a raw goal
    holding a hand-written template that starts with the BOS text got two (Llama 3's [128000, 128000, ...])."""
    ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)  # (a plain callable tokenizer: none)
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        # the tokenizer's own BOS only (one that adds none, GPT-2's, keeps a prompt's two typed BOS tokens)
        if ids[1:] == list(tokenizer(prompt, add_special_tokens=False)["input_ids"]):
            del ids[0]
    return ids


def _rendered(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    try:
        encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                sanitize_control_tokens=True)
    except Exception as exc:  # jinja2 SecurityError / TemplateError / raise_exception() in the template
        raise ChatTemplateError(f"the model's chat template failed: {type(exc).__name__}: {exc}") from exc
    return [int(t) for t in encoded["input_ids"]]


def _forged_control(tokenizer, turns: list[dict[str, str]], ids: list[int], names: list[str]) -> str:
    """'' unless a turn's content put a control id into ``ids``: the ids of the tokenizer's control tokens (special,
    or added and written by the template) must be those the same conversation gets with each such string in its
    content blanked out (rendered again only where a content holds one). The sanitizer is transformers' (since
    5.x): an older release takes the unknown keyword as a template variable and tokenizes the string as the control
    id; the goal is then refused, naming the token, rather than run forged. (A template that builds a marker from
    pieces, such as '<|' + role + '|>', with a token not marked special and not in its literal text, is caught by
    neither unless the tokenizer lists it in chat_control_tokens.) ``names``: each turn's name in the goal."""
    added = {int(i): (str(t.content), getattr(t, "special", False))
             for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
             if str(t.content) and not any(c.isspace() for c in str(t.content))}  # "\n" tokens: plain text
    if not any(text in turn["content"] for turn in turns for text, _ in added.values()):
        return ""  # the common case, no added token's string anywhere: nothing to check
    template = str(getattr(tokenizer, "chat_template", "") or "")
    # transformers' own set where it has one (special tokens, chat_control_tokens or the added tokens in the
    # template's literal text); else special tokens and the added ones the template's source holds
    known = getattr(tokenizer, "_get_control_tokens", None)
    try:
        named = set(known(template)) if known is not None else None
    except Exception:  # a private helper of another release: the plain rule below
        named = None
    controls = {i: text for i, (text, special) in added.items()
                if (text in named if named is not None else special or text in template)}
    texts = sorted(set(controls.values()), key=len, reverse=True)
    held = [(name, turn) for name, turn in zip(names, turns, strict=True) if any(t in turn["content"] for t in texts)]
    if not held:
        return ""

    def blanked(content: str) -> str:
        for text in texts:
            content = content.replace(text, " ")  # a space: the pieces either side cannot join into another
        return content if content.strip() else "x"

    neutral = _rendered(tokenizer, [dict(t, content=blanked(t["content"])) for t in turns])
    if Counter(i for i in ids if i in controls) == Counter(i for i in neutral if i in controls):
        return ""
    name, turn = held[0]
    token = next(text for text in texts if text in turn["content"])
    return (f"{name} contains {token!r}, which this tokenizer and chat template read as a control id (it could"
            " end the turn and forge another): reword it (or update transformers, whose sanitize_control_tokens"
            " reads such strings as text)")


def special_token_strings(tokenizer) -> list[str]:
    """The text of every special token the tokenizer recognises in its input (bos/eos/pad/unk, the additional
    special tokens and every added token marked special), longest first, without repeats."""
    found = {str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ()}
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(str(added.content))
    return sorted((t for t in found if t), key=lambda t: (-len(t), t))


def stop_string_error(stop_strings: Iterable[str], tokenizer, end_ids: Sequence[int] = ()) -> str:
    """'' when every stop string can match the output text, else why one cannot: the text is decoded without
    special tokens, so a stop string holding one (``<|im_start|>``, ``<end_of_turn>``, as llama.cpp configurations
    list them) never matched and the goal ran to its length silently. A stop string that is exactly one special
    token passes: an end token (the tokenizer's eos or one of ``end_ids``, the model's end ids) ends generation
    anyway, so the redundant stop that OpenAI- and llama.cpp-style clients send does no harm, and any other ends it
    at that token (:func:`stop_token_ids`). ``end_ids``: the ids this generation
    ends at (the tokenizer's eos only where it is among them: a run that does not end there would never stop on
    its text)."""
    specials = special_token_strings(tokenizer) if tokenizer is not None else []
    if not specials:
        return ""
    ends: list[int] = []
    _extend(ends, end_ids)
    end_texts = set(tokenizer.convert_ids_to_tokens(ends)) if ends else set()
    for stop in stop_strings:
        if stop in end_texts or (stop in specials and special_token_id(tokenizer, stop) is not None):
            # exactly one special token: the generation ends at that token (stop_token_ids)
            continue
        token = next((t for t in specials if t in stop), None)
        if token is not None:
            return (f"stop string {stop!r} contains the special token {token!r}, which never appears in the output"
                    " text (special tokens are not decoded into it): give the special token alone to end there"
                    + (f"; generation already ends at the model's end token(s) {sorted(end_texts)}" if end_texts
                       else "; this generation ends at no end token"))
    return ""


def stop_token_ids(stop_strings: Iterable[str], tokenizer) -> list[int]:
    """The ids of the stop strings that are exactly one special token: the output text never shows a special token,
    so such a stop string could never match it; the generation ends at that token instead (finish reason stop). A
    raw continuation of an instruct model, whose end tokens are its end of turn, ends at ``<|endoftext|>`` this way."""
    specials = set(special_token_strings(tokenizer)) if tokenizer is not None else set()
    ids = [special_token_id(tokenizer, stop) for stop in stop_strings if stop in specials]
    return [i for i in ids if i is not None]


def special_token_id(tokenizer, token: str) -> int | None:
    """The id of the special token ``token``, None where the tokenizer has none for it (a slow tokenizer answers an
    unknown string with its unk id, a fast one without an unk token with None)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found < 0 or tokenizer.convert_ids_to_tokens(found) != token:
        return None
    return found


def end_token_ids(tokenizer, model=None) -> list[int]:
    """Ids that end a generation: the tokenizer's eos token, then every id of the model's
    ``generation_config.eos_token_id`` (an int or a list; instruct models put their end-of-turn
    token there), then the special token the chat template writes right after an assistant turn's content
    (:func:`template_end_of_turn`), without repeats. The last for a model folder whose eos and generation
    config name only the end of a document (a ChatML template over a base model's ``<|endoftext|>``): it ran on
    past ``<|im_end|>``, which the output text does not show, into made-up turns until its length."""
    ids: list[int] = []
    _extend(ids, [getattr(tokenizer, "eos_token_id", None)] if tokenizer is not None else [])
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    _extend(ids, eos if isinstance(eos, (list, tuple)) else [eos])
    _extend(ids, [template_end_of_turn(tokenizer)] if tokenizer is not None else [])
    return ids


_PROBE = "\ue000"  # a private-use character: no template writes it, so it marks where the content went


def template_end_of_turn(tokenizer) -> int | None:
    """The id of the special token the chat template writes right after an assistant turn's content (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``); None without a template, where the
    template fails on a probe conversation, or where no special token follows the content."""
    if not has_chat_template(tokenizer):
        return None
    probe = [{"role": USER, "content": "u"}, {"role": ASSISTANT, "content": _PROBE}]
    try:
        rendered = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template that refuses this conversation: the other end ids stand
        return None
    at = rendered.find(_PROBE)
    if at < 0:
        return None
    after = rendered[at + len(_PROBE):]
    token = next((t for t in special_token_strings(tokenizer) if after.startswith(t)), None)
    if token is None:
        return None
    found = tokenizer.convert_tokens_to_ids(token)
    return found if isinstance(found, int) and found >= 0 else None


def _extend(ids: list[int], values: Iterable) -> None:
    for value in values:
        if value is not None and int(value) >= 0 and int(value) not in ids:
            ids.append(int(value))
