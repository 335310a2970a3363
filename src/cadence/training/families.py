"""The broader prompt families of self-distillation: translation, summarize, extract,
chat-context, passage-qa, roleplay, stem and humanities.

Knows: how each family builds its prompts, all offline: passages (``cadence.training.passages``:
ShareGPT training replies, Python's own documentation), sentences of training conversations,
earlier turns of training conversations, and templates over the topic and persona lists of
``cadence.training.topics``.
Does not know: evaluation prompts or how families are mixed (``cadence.training.sources``
filters and interleaves them), tokenizers, models, shards.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from functools import lru_cache

from cadence.prompts import PromptItem, sharegpt_items
from cadence.training import topics
from cadence.training.passages import (
    ascii_share, is_code_request, is_prose, MARKUP, Passage, python_doc_passages, SENTENCE_END, sharegpt_passages,
    train_conversations,
)


@lru_cache(maxsize=1)
def _sharegpt_train() -> tuple[PromptItem, ...]:
    return tuple(sharegpt_items("train"))


# ---------------------------------------------------------------- shuffling (shared with sources' mixing)


def _shuffled(items: list[PromptItem], tag: str) -> list[PromptItem]:
    """``items`` in an order fixed by ``tag`` (a seed and a family name)."""
    items = list(items)
    random.Random(tag).shuffle(items)
    return items


def _alternate(lists: list[list[PromptItem]]) -> Iterator[PromptItem]:
    """Round robin over ``lists``: the first of each, then the second of each, ..."""
    for i in range(max((len(x) for x in lists), default=0)):
        for x in lists:
            if i < len(x):
                yield x[i]


def _pick(rng: random.Random, xs):
    return xs[rng.randrange(len(xs))]


def _rng(seed: int, *parts) -> random.Random:
    return random.Random(":".join(map(str, (seed,) + parts)))


# ---------------------------------------------------------------- translation

_TO_X = ["Translate into {lang}: {s}", "Translate the following sentence from English to {lang}:\n\n{s}",
         "How would you say this in {lang}?\n\n\"{s}\"", "Please translate this text into {lang}.\n\n{s}",
         "{s}\n\nTranslate the sentence above into {lang}.", "Give a natural {lang} translation of: {s}",
         "Translate to {lang}, keeping the tone of the original:\n{s}"]
_TO_EN = ["Translate into English: {s}", "Translate the following text to English:\n\n{s}",
          "What does this mean in English?\n\n{s}", "{s}\n\nPlease translate this into English.",
          "Translate this into English and keep the formatting:\n\n{s}"]
_FOREIGN_WORDS = frozenset(
    "el la los las que y en un una por para con es del al se no le les des et est pour dans une du au der die "
    "das und ist nicht mit den ein eine zu auf von sich os um uma em não il di che è per della het een van niet "
    "ik je wij zijn voor".split())
_ENGLISH_WORDS = frozenset("the and of to is in that it for you with on this are be as was have not what can "
                           "your".split())


_NON_LATIN = re.compile("[\u0370-\u03ff\u0400-\u04ff\u0600-\u06ff\u0900-\u097f\u3040-\u30ff\u4e00-\u9fff"
                        "\uac00-\ud7af]")


def is_foreign(text: str) -> bool:
    """Text mostly not in English: mostly non-Latin script (Cyrillic, Greek, Arabic,
    Devanagari, kana, CJK, Hangul), or Latin script whose function words are mostly those of
    Spanish, French, German, Portuguese, Italian or Dutch."""
    if len(_NON_LATIN.findall(text)) >= 0.3 * max(len(text) - text.count(" "), 1):
        return True
    words = re.findall(r"[a-zà-ÿ]+", text.lower())
    foreign = sum(w in _FOREIGN_WORDS for w in words)
    return foreign >= 4 and foreign > 2 * sum(w in _ENGLISH_WORDS for w in words)


def _head(text: str, limit: int) -> str:
    """``text`` cut after the last sentence end (., !, ?, 。, ！, ？, 다.) before ``limit`` characters."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(ch, 0, limit) for ch in ".!?。！？")
    return text[:cut + 1] if cut > limit // 3 else ""


@lru_cache(maxsize=1)
def english_sentences() -> tuple[tuple[str, str], ...]:
    """(key, text): one or two consecutive prose sentences from each training ShareGPT
    assistant reply (40-240 characters, no markup), for English -> X requests."""
    out = []
    for key, turns in train_conversations():
        for t, (role, text) in enumerate(turns):
            if role != "assistant" or MARKUP.search(text):
                continue
            first = text.split("\n", 1)[0].strip()
            sents = SENTENCE_END.split(first)
            rng = _rng(0, "sentences", key, t)
            if not sents:
                continue
            i = rng.randrange(len(sents))
            s = " ".join(sents[i:i + rng.choice((1, 1, 2))])
            if 40 <= len(s) <= 240 and s[-1] in ".!?" and s[0].isupper() and is_prose(s) and ":" not in s:
                out.append((f"{key}:{t}", s))
    return tuple(out)


@lru_cache(maxsize=1)
def foreign_texts() -> tuple[tuple[str, str], ...]:
    """(key, text): training ShareGPT turns (human or assistant) not in English
    (``is_foreign``), cut to at most 400 characters at a sentence end, no code."""
    out = []
    for key, turns in train_conversations():
        for t, (_, text) in enumerate(turns):
            if "```" in text or len(text) < 20 or not is_foreign(text[:600]):
                continue
            s = _head(text.strip(), 400)
            if len(s) >= 20 and is_foreign(s) and not MARKUP.search(s) and not re.search(r"\[\d+\]", s):
                out.append((f"{key}:{t}", s))
    return tuple(out)


def translation_items(seed: int = 0) -> list[PromptItem]:
    """English -> one of ``topics.LANGUAGES`` (sentences of training ShareGPT replies, and
    ``topics.EVERYDAY`` sentences into every language), and non-English training ShareGPT
    turns -> English (or, one in four, another language), alternated."""
    to_x = []
    for key, s in english_sentences():
        rng = _rng(seed, "translation", key)
        to_x.append(PromptItem(key=f"translation:{key}",
                               prompt=_pick(rng, _TO_X).format(lang=_pick(rng, topics.LANGUAGES), s=s)))
    everyday = []
    for i, s in enumerate(topics.EVERYDAY):
        for lang in dict.fromkeys(topics.LANGUAGES):
            rng = _rng(seed, "translation-everyday", i, lang)
            everyday.append(PromptItem(key=f"translation-everyday:{i}:{lang}",
                                       prompt=_pick(rng, _TO_X).format(lang=lang, s=s)))
    from_x = []
    for key, s in foreign_texts():
        rng = _rng(seed, "translation", key)
        if rng.random() < 0.25:
            lang = _pick(rng, ["Spanish", "French", "German", "Chinese", "Japanese"])
            prompt = _pick(rng, _TO_X).replace("from English ", "").format(lang=lang, s=s)
        else:
            prompt = _pick(rng, _TO_EN).format(s=s)
        from_x.append(PromptItem(key=f"translation:{key}", prompt=prompt))
    return list(_alternate([_shuffled(to_x, f"{seed}:translation:en"), _shuffled(from_x, f"{seed}:translation:x"),
                            _shuffled(everyday, f"{seed}:translation:everyday")]))


# ---------------------------------------------------------------- summarize

_SUMMARIZE = ["Summarize the following text in {n} sentences:\n\n{p}", "Write a short summary of this passage:\n\n{p}",
              "Give a TL;DR of the text below.\n\n{p}", "{p}\n\nSummarize the text above in one paragraph.",
              "Summarize the key points of the text below as a bulleted list.\n\n{p}",
              "Condense this into a single sentence:\n\n{p}",
              "Read the passage and write a summary of at most {w} words.\n\nPassage:\n{p}",
              "Write a headline and a two-sentence summary for the following text.\n\n{p}",
              "Explain the gist of this text to someone in a hurry:\n\n{p}"]


def _passage_pool(seed: int, family: str) -> list[list[Passage]]:
    return [_shuffled(list(sharegpt_passages()), f"{seed}:{family}:sharegpt"),
            _shuffled(list(python_doc_passages()), f"{seed}:{family}:pydoc")]


def summarize_items(seed: int = 0) -> list[PromptItem]:
    """One summarization request per passage (training ShareGPT replies, Python docs),
    the wording drawn per passage; ShareGPT and Python-doc passages alternate."""
    lists = []
    for pool in _passage_pool(seed, "summarize"):
        items = []
        for p in pool:
            rng = _rng(seed, "summarize", p.key)
            prompt = _pick(rng, _SUMMARIZE).format(p=p.text, n=rng.choice((2, 3)), w=rng.choice((30, 50, 80)))
            items.append(PromptItem(key=f"summarize:{p.key}", prompt=prompt))
        lists.append(items)
    return list(_alternate(lists))


# ---------------------------------------------------------------- extract

_EXTRACT_PASSAGE = [
    "Extract all named entities (people, organizations, places, products) from the text below and return them "
    "as a JSON object with one list per type.\n\n{p}",
    "List every number in the following text together with what it refers to.\n\n{p}",
    "From the passage below, extract the main topic and three key facts. Answer in JSON with the keys "
    "\"topic\" and \"facts\".\n\n{p}",
    "Pull out the technical terms used in this text and give a one-line definition of each.\n\n{p}",
    "Extract the steps or recommendations in the following text as a numbered list.\n\n{p}",
    "Read the text and extract its keywords (at most ten), comma-separated.\n\n{p}",
    "{p}\n\nFrom the text above, extract each claim it makes as a separate bullet point.",
]
_EXTRACT_RECORD = ["Extract the following fields as JSON ({fields}) from this text:\n\n{text}",
                   "From the text below, pull out {fields}. Answer as a list.\n\n{text}",
                   "{text}\n\nReturn a JSON object with the keys {keys}.",
                   "Parse this message into a table with the columns {fields}.\n\n{text}",
                   "Read the following and fill in: {fields}.\n\n{text}"]


def _record(rng: random.Random, kind: int) -> tuple[str, list[str]]:
    """A made-up message of one of ten kinds (names, places and numbers from ``topics``) and
    the fields to extract from it."""
    T = topics
    first, last, city = _pick(rng, T.FIRST_NAMES), _pick(rng, T.LAST_NAMES), _pick(rng, T.CITIES)
    other = f"{_pick(rng, T.FIRST_NAMES)} {_pick(rng, T.LAST_NAMES)}"
    company, product, month = _pick(rng, T.COMPANIES), _pick(rng, T.PRODUCTS), _pick(rng, T.MONTHS)
    day, year, n = rng.randint(1, 28), rng.randint(2019, 2027), rng.randint(2, 9)
    price = f"{rng.randint(5, 400)}.{rng.choice(('00', '50', '99', '25'))}"
    if kind == 0:
        return (f"Hi {first}, thanks for your order #{rng.randint(1000, 99999)} placed on {day} {month} {year}. You "
                f"bought {n} x {product} at {price} EUR each from {company}. Your parcel will be sent to {city} "
                f"within {rng.randint(2, 7)} working days.",
                ["customer name", "order number", "order date", "product", "quantity", "unit price",
                 "delivery city"])
    if kind == 1:
        job = _pick(rng, T.JOBS)
        return (f"{company} is hiring a {job} for its {city} office. The role is "
                f"{rng.choice(('full-time', 'part-time', 'a one-year contract'))}, pays {rng.randint(28, 120)},000 "
                f"a year and starts on {day} {month}. You need at least {n} years of experience. Send your CV to "
                f"{first.lower()}.{last.lower()}@example.com before the end of {month}.",
                ["company", "job title", "location", "contract type", "salary", "start date", "experience required",
                 "contact email"])
    if kind == 2:
        event = rng.choice(("book fair", "jazz night", "science festival", "charity run", "food market", "film club"))
        return (f"Join us on {month} {day} at {rng.randint(10, 20)}:{rng.choice(('00', '30'))} in the town hall of "
                f"{city} for our {event}. Tickets cost {price} EUR, and children under {rng.randint(6, 14)} get in "
                f"free. For group bookings call {first} {last} on 0{rng.randint(100, 999)} {rng.randint(100000, 999999)}.",
                ["event", "date", "time", "venue", "ticket price", "free for", "contact name", "phone number"])
    if kind == 3:
        return (f"Bright {n}-room flat for rent in central {city}: {rng.randint(35, 140)} square metres on the "
                f"{rng.randint(1, 8)}th floor, {rng.choice(('with', 'without'))} a balcony, "
                f"{rng.choice(('pets allowed', 'no pets'))}. Rent {rng.randint(600, 2600)} per month plus "
                f"{rng.randint(80, 300)} for utilities, available from {day} {month}. Viewings with {first}.",
                ["city", "rooms", "size", "floor", "balcony", "pets", "rent", "utilities", "available from"])
    if kind == 4:
        a, b = _pick(rng, T.CITIES), _pick(rng, T.CITIES)
        return (f"Booking confirmed for {first} {last}: flight {rng.choice('ABCDEFKLU')}{rng.choice('ABCDEFKLU')}"
                f"{rng.randint(100, 9999)} from {a} to {b} on {day} {month} {year}, departing "
                f"{rng.randint(5, 22)}:{rng.choice(('05', '20', '45', '55'))}, seat {rng.randint(1, 40)}"
                f"{rng.choice('ABCDEF')}, {rng.choice(('one checked bag', 'hand luggage only', 'two checked bags'))}.",
                ["passenger", "flight number", "origin", "destination", "date", "departure time", "seat", "baggage"])
    if kind == 5:
        return (f"Reminder: {first} {last} has an appointment with Dr {_pick(rng, T.LAST_NAMES)} "
                f"({rng.choice(('dentist', 'eye clinic', 'physiotherapy', 'general practice'))}) on {day} {month} at "
                f"{rng.randint(8, 17)}:{rng.choice(('00', '15', '30', '45'))}, room {rng.randint(1, 30)}, "
                f"{company}, {city}. Please arrive ten minutes early and bring your insurance card.",
                ["patient", "doctor", "department", "date", "time", "room", "place"])
    if kind == 6:
        item = _pick(rng, T.PRODUCTS)
        return (f"Meeting notes, {day} {month}. Present: {first} {last}, {other}. Decided: switch supplier for "
                f"{item} to {company}. Actions: {first} drafts the contract by {month} {min(day + n, 28)}; "
                f"{other.split()[0]} checks the budget ({price} per unit) before the next meeting.",
                ["date", "attendees", "decisions", "action items with owner and deadline"])
    if kind == 7:
        stars = rng.randint(1, 5)
        return (f"{stars} out of 5. I bought {product} from {company} in {month}. "
                f"{rng.choice(('Delivery was quick', 'It arrived a week late', 'Packaging was excellent'))}, and "
                f"{rng.choice(('it works as described', 'the build quality is poor', 'it is lighter than expected'))}"
                f". At {price} EUR {rng.choice(('it is good value', 'it is overpriced', 'the price is fair'))}. "
                f"- {first}, {city}",
                ["rating", "product", "seller", "pros", "cons", "price", "reviewer", "reviewer location"])
    if kind == 8:
        qty2 = rng.randint(1, 5)
        return (f"Invoice {year}-{rng.randint(100, 999)} from {company} to {first} {last}, {city}. "
                f"{n} hours of consulting at {rng.randint(40, 150)} EUR per hour; {qty2} x {product} at {price} EUR. "
                f"VAT {rng.choice((7, 10, 19, 20, 21))}%. Payment due by {day} {month} {year}.",
                ["invoice number", "seller", "buyer", "line items", "VAT rate", "due date"])
    return (f"{first} {last} ({_pick(rng, T.JOBS)} at {company}) moved from {city} to {_pick(rng, T.CITIES)} in "
            f"{month} {year}. New phone: +{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(1000000, 9999999)}; "
            f"email {first.lower()}@{company.split()[0].lower()}.example.",
            ["name", "job title", "employer", "old city", "new city", "date of move", "phone", "email"])


def extract_items(seed: int = 0, records_per_kind: int = 300) -> list[PromptItem]:
    """Extraction requests over passages (training ShareGPT replies, Python docs) alternating
    with made-up records (orders, job ads, events, listings, bookings, appointments, meeting
    notes, reviews, invoices, contact changes; ``records_per_kind`` of each)."""
    lists = []
    for pool in _passage_pool(seed, "extract"):
        items = []
        for p in pool:
            rng = _rng(seed, "extract", p.key)
            items.append(PromptItem(key=f"extract:{p.key}", prompt=_pick(rng, _EXTRACT_PASSAGE).format(p=p.text)))
        lists.append(items)
    records = []
    for kind in range(10):
        for i in range(records_per_kind):
            rng = _rng(seed, "extract-record", kind, i)
            text, fields = _record(rng, kind)
            keys = ", ".join('"' + f.replace(" ", "_") + '"' for f in fields)
            prompt = _pick(rng, _EXTRACT_RECORD).format(text=text, fields=", ".join(fields), keys=keys)
            records.append(PromptItem(key=f"extract-record:{kind}:{i}", prompt=prompt))
    lists.insert(1, _shuffled(records, f"{seed}:extract:records"))
    return list(_alternate(lists))


# ---------------------------------------------------------------- chat-context

_CONTEXT_CHARS = 800  # all messages of a chat-context prompt together (fits 256 prompt tokens)
_FOLLOW_UPS = ["Can you make that shorter?", "Now explain it as if I were ten years old.",
               "Give me three concrete examples.", "Turn your answer into a bulleted list.",
               "Rewrite your answer in a more formal tone.", "What are the main drawbacks or risks?",
               "Can you summarize that in one sentence?", "Translate your last answer into Spanish.",
               "Which of those points matters most, and why?", "Can you expand on the second point?",
               "Suggest a short title for this.", "Now give me the strongest counterargument.",
               "How would you explain this to an expert instead?", "Add a short conclusion to that.",
               "Thanks! Can you give me a step-by-step plan based on that?", "Is any of that likely to be wrong?",
               "Say the same thing, but more casually.", "What should I read next to learn more about this?"]


def chat_context_items(seed: int = 0) -> list[PromptItem]:
    """Conversations so far, ending at a human turn, with the earlier turns in ``history``:
    (a) every human turn after the first of a training ShareGPT conversation whose messages up
    to it total at most ``_CONTEXT_CHARS``; (b) the first exchange of a training conversation
    (human turn and reply, short enough) followed by a templated follow-up. (a) and (b)
    alternate."""
    real, follow = [], []
    for key, turns in train_conversations():
        total = 0
        for t, (role, text) in enumerate(turns):
            total += len(text)
            if total > _CONTEXT_CHARS:
                break
            if t >= 2 and role == "user" and turns[t - 1][0] == "assistant":
                real.append(PromptItem(key=f"chat-context:{key}:{t}", prompt=text, history=turns[:t]))
        if len(turns) >= 2 and turns[1][0] == "assistant":
            first = turns[:2]
            if sum(len(x) for _, x in first) <= _CONTEXT_CHARS - 80 and not is_foreign(first[0][1]):
                rng = _rng(seed, "chat-context", key)
                follow.append(PromptItem(key=f"chat-context-follow:{key}", prompt=_pick(rng, _FOLLOW_UPS),
                                         history=first))
    return list(_alternate([_shuffled(real, f"{seed}:chat-context:real"),
                            _shuffled(follow, f"{seed}:chat-context:follow")]))


# ---------------------------------------------------------------- passage-qa

_QA_WITH_QUESTION = ["Answer the question using only the information in the context.\n\nContext:\n{p}\n\nQuestion: {q}",
                     "Context: {p}\n\nBased on the context above, answer this question: {q}",
                     "Here is a document:\n\n{p}\n\nUsing the document, answer: {q}",
                     "Read the following passage and answer the question.\n\nPassage: {p}\n\nQuestion: {q}\nAnswer:",
                     "Question: {q}\n\nUse this reference text to answer it:\n{p}"]
_QA_GENERIC = ["What is the main point of the passage below?\n\n{p}",
               "Read the text and answer: what does it recommend, and why?\n\n{p}",
               "{p}\n\nAccording to the passage above, what are the most important details?",
               "What examples or evidence does this text give to support its point?\n\n{p}",
               "Read the passage. Which statement in it would a reader most likely question, and why?\n\n{p}",
               "{p}\n\nWhat does the text say about {term}?",
               "Based only on the following text, what can we conclude about {term}?\n\n{p}"]
_TERM = re.compile(r"\b[A-Za-z][a-z]{5,}\b")
_STOP_TERMS = frozenset("should should would could their there these those which where while about other "
                        "because before after through between without within important different example "
                        "following however include includes including provide provides person people "
                        "something someone things using information".split())


def _term(text: str, rng: random.Random) -> str | None:
    """A word the passage repeats (at least twice, 6+ letters, not a common word), or None."""
    counts: dict[str, int] = {}
    for w in _TERM.findall(text):
        w = w.lower()
        if w not in _STOP_TERMS:
            counts[w] = counts.get(w, 0) + 1
    best = sorted((w for w, c in counts.items() if c >= 2), key=lambda w: (-counts[w], w))[:3]
    return _pick(rng, best) if best else None


def _snippet(text: str) -> str:
    return _head(text, 220) or text[:220].rsplit(" ", 1)[0] + " ..."


def passage_qa_items(seed: int = 0) -> list[PromptItem]:
    """Questions over given text: (a) a training ShareGPT reply as context with the question
    that reply answered; (b) three numbered snippets (the opening of three replies), the
    question of one of them; (c) generic or term questions over a passage (ShareGPT replies
    without a usable question, Python docs). (a), (b), (c) alternate."""
    share, docs = _passage_pool(seed, "passage-qa")
    direct, multi, generic = [], [], []
    for i, p in enumerate(share):
        rng = _rng(seed, "passage-qa", p.key)
        if p.question is None:
            term = _term(p.text, rng)
            tpl = _pick(rng, _QA_GENERIC if term else [t for t in _QA_GENERIC if "{term}" not in t])
            generic.append(PromptItem(key=f"passage-qa:{p.key}", prompt=tpl.format(p=p.text, term=term)))
            continue
        direct.append(PromptItem(key=f"passage-qa:{p.key}",
                                 prompt=_pick(rng, _QA_WITH_QUESTION).format(p=p.text, q=p.question)))
        others = [share[(i + k * 7919) % len(share)] for k in (1, 2)]
        snippets = [p] + others
        rng.shuffle(snippets)
        body = "\n".join(f"[{j + 1}] {_snippet(s.text)}" for j, s in enumerate(snippets))
        multi.append(PromptItem(key=f"passage-qa-multi:{p.key}",
                                prompt=f"Search results:\n{body}\n\nUsing the search results, answer the question and "
                                       f"say which result you used.\nQuestion: {p.question}"))
    for p in docs:
        rng = _rng(seed, "passage-qa", p.key)
        term = _term(p.text, rng)
        tpl = _pick(rng, _QA_GENERIC if term else [t for t in _QA_GENERIC if "{term}" not in t])
        generic.append(PromptItem(key=f"passage-qa:{p.key}", prompt=tpl.format(p=p.text, term=term)))
    return list(_alternate([direct, multi, _shuffled(generic, f"{seed}:passage-qa:generic")]))


# ---------------------------------------------------------------- roleplay

_ROLE_SYSTEM = ["You are {p}. Stay in character and answer in the first person.",
                "You are {p}. Speak the way {p} would, and never mention being an AI.",
                "Role-play as {p}. Keep your answers vivid but brief."]
_ROLE_USER = ["Pretend to be {p}. {t}", "Let's role-play: you are {p} and I am a curious visitor. {t}",
              "Imagine you are {p}. Answer in character: {t}", "For this conversation, speak as {p}. {t}",
              "You are {p}. {t}"]
_ROLEPLAY_REQUEST = re.compile(r"\b(?:act as|pretend (?:to be|you are|you're)|role-?play|imagine (?:you are|you're)|"
                               r"you are now|stay in character|in character)\b", re.IGNORECASE)


def _sharegpt_human_turns() -> Iterator[tuple[str, str]]:
    """(key, text) of every human turn of the training conversations (first turns ``sharegpt:ID``,
    later ones ``sharegpt:ID:TURN``, the keys of the ``sharegpt`` and ``sharegpt-turns`` sources)."""
    for key, turns in train_conversations():
        for t, (role, text) in enumerate(turns):
            if role == "user":
                yield (key if t == 0 else f"{key}:{t}"), text


def roleplay_items(seed: int = 0) -> list[PromptItem]:
    """Persona x opening turn (``topics.PERSONAS`` x ``topics.ROLEPLAY_TURNS``): each pair once
    with the persona as a system message, once with the persona set up in the user's turn;
    alternating with training ShareGPT human turns that ask for role-play."""
    system, user = [], []
    for i, persona in enumerate(topics.PERSONAS):
        for j, turn in enumerate(topics.ROLEPLAY_TURNS):
            rng = _rng(seed, "roleplay", i, j)
            system.append(PromptItem(key=f"roleplay-system:{i}:{j}", prompt=turn,
                                     history=(("system", _pick(rng, _ROLE_SYSTEM).format(p=persona)),)))
            user.append(PromptItem(key=f"roleplay-user:{i}:{j}", prompt=_pick(rng, _ROLE_USER).format(p=persona, t=turn)))
    share = [PromptItem(key=key, prompt=text) for key, text in _sharegpt_human_turns()
             if _ROLEPLAY_REQUEST.search(text[:600]) and 20 <= len(text) <= 1500]
    return list(_alternate([_shuffled(system, f"{seed}:roleplay:system"), _shuffled(share, f"{seed}:roleplay:sharegpt"),
                            _shuffled(user, f"{seed}:roleplay:user")]))


# ---------------------------------------------------------------- stem, humanities

_STEM_CONCEPT = ["Explain {c} in simple terms.", "What is {c}, and why does it matter?",
                 "How does {c} work? Give an everyday example.", "Explain {c} to a high-school student.",
                 "What are common misconceptions about {c}?", "Describe {c} and give one real-world application.",
                 "Give a short, precise explanation of {c} for a university student.",
                 "Write a study note on {c} with a definition, a key formula or fact, and an example."]
_STEM_PAIR = ["What is the difference between {a} and {b}?", "Compare {a} and {b}, with an example of each.",
              "Why do people confuse {a} and {b}? Explain how to tell them apart."]
_STEM_REQUEST = re.compile(
    r"\b(?:physics|chemistry|chemical|biolog\w*|molecul\w*|atoms?|electrons?|quantum|equations?|theorem|calculus|"
    r"algebra|geometry|probability|statistic\w*|derivative|integral|matri(?:x|ces)|velocity|acceleration|"
    r"gravity|energy|voltage|circuit|photosynthesis|genes?|DNA|proteins?|enzymes?|cells?|evolution|planets?|"
    r"orbit|climate|thermodynamic\w*|entropy|neurons?|vaccines?|bacteria|virus)\b", re.IGNORECASE)
_HUMANITIES_REQUEST = re.compile(
    r"\b(?:history|historical|historian|philosoph\w*|ethic\w*|moral\w*|literature|literary|novel|poet|"
    r"shakespeare|art history|painting|painter|renaissance|medieval|ancient|empire|revolution|century|"
    r"constitution\w*|legal|law|court|economics|economy|economic|inflation|recession|religio\w*|theology|"
    r"culture|cultural|sociolog\w*|anthropolog\w*|linguistic\w*|democracy|politic\w*)\b", re.IGNORECASE)


def _classified_turns(pattern: re.Pattern, seed: int, family: str) -> list[PromptItem]:
    """Training ShareGPT human turns (20-1000 characters, English, not code requests) whose
    text matches ``pattern``, under their ShareGPT keys."""
    out = [PromptItem(key=key, prompt=text) for key, text in _sharegpt_human_turns()
           if 20 <= len(text) <= 1000 and pattern.search(text) and not is_code_request(text)
           and not is_foreign(text) and ascii_share(text) >= 0.97]
    return _shuffled(out, f"{seed}:{family}:sharegpt")


def stem_items(seed: int = 0, draws_per_problem: int = 30) -> list[PromptItem]:
    """STEM explanations (``topics.STEM_CONCEPTS`` x wordings), comparisons
    (``topics.STEM_PAIRS``), worked problems with drawn numbers (``topics.STEM_PROBLEMS``,
    ``draws_per_problem`` each), and training ShareGPT human turns on science or maths
    (keywords), alternating templated and ShareGPT prompts."""
    templated = [PromptItem(key=f"stem:{i}:{j}", prompt=tpl.format(c=c))
                 for i, c in enumerate(topics.STEM_CONCEPTS) for j, tpl in enumerate(_STEM_CONCEPT)]
    templated += [PromptItem(key=f"stem-pair:{i}:{j}", prompt=tpl.format(a=a, b=b))
                  for i, (a, b) in enumerate(topics.STEM_PAIRS) for j, tpl in enumerate(_STEM_PAIR)]
    for i, (tpl, ranges) in enumerate(topics.STEM_PROBLEMS):
        for k in range(draws_per_problem):
            rng = _rng(seed, "stem-problem", i, k)
            values = {name: rng.randint(lo, hi) for name, (lo, hi) in ranges.items()}
            templated.append(PromptItem(key=f"stem-problem:{i}:{k}", prompt=tpl.format(**values)))
    return list(_alternate([_shuffled(templated, f"{seed}:stem:templated"),
                            _classified_turns(_STEM_REQUEST, seed, "stem")]))


_HUM_EVENT = ["What were the main causes of {x}?", "Explain the long-term consequences of {x}.",
              "Describe {x} for someone who knows nothing about it.", "Why do historians still debate {x}?",
              "Write a short essay on the significance of {x}.", "What was daily life like for ordinary people during {x}?"]
_HUM_THINKER = ["Summarize the main ideas of {x}.", "How did {x} influence later thinkers?",
                "What would {x} say about social media? Argue from their ideas.",
                "Explain one famous argument of {x} and a common objection to it.",
                "Write a short introduction to {x} for a first-year student."]
_HUM_IDEA = ["Explain {x} with an everyday example.", "What are the strongest arguments for and against {x}?",
             "How has {x} been used or criticised in modern debates?", "Explain {x} in three paragraphs.",
             "Give a thought experiment that illustrates {x}."]
_HUM_WORK = ["What are the main themes of {w} by {a}?", "Give a short plot summary of {w} by {a}.",
             "Why is {w} by {a} considered important?", "Analyse one central character of {w} by {a}.",
             "How does {a} use symbolism in {w}?", "Write a short study guide for {w} by {a}."]
_HUM_ART = ["What characterises {x}?", "Explain the history of {x} and name a few notable works.",
            "How did {x} change the way people saw art?", "Describe {x} to someone visiting a museum for the first time.",
            "What influenced {x}, and what did it influence?"]
_HUM_LAW_ECON = ["Explain {x} in plain language.", "Why does {x} matter in everyday life? Give an example.",
                 "What are the main criticisms of {x}?", "Explain {x} with a simple numerical or real-world example.",
                 "How has thinking about {x} changed over the last century?", "Write a one-page explainer on {x}."]
_HUM_PAIR = ["Compare {a} and {b}.", "What are the key similarities and differences between {a} and {b}?",
             "Which had the greater influence, {a} or {b}? Argue your answer."]


def humanities_items(seed: int = 0) -> list[PromptItem]:
    """Humanities questions from ``topics`` lists (history events, thinkers, ideas, literary
    works, arts, law and economics, comparisons) x wordings, alternating with training
    ShareGPT human turns on history, philosophy, literature, art, law, economics, society
    (keywords)."""
    T = topics
    groups = [(T.HISTORY_EVENTS, _HUM_EVENT, "event"), (T.THINKERS, _HUM_THINKER, "thinker"),
              (T.IDEAS, _HUM_IDEA, "idea"), (T.ARTS, _HUM_ART, "art"), (T.LAW_ECON, _HUM_LAW_ECON, "law-econ")]
    templated = [PromptItem(key=f"humanities-{tag}:{i}:{j}", prompt=tpl.format(x=x))
                 for xs, tpls, tag in groups for i, x in enumerate(xs) for j, tpl in enumerate(tpls)]
    templated += [PromptItem(key=f"humanities-work:{i}:{j}", prompt=tpl.format(a=a, w=w))
                  for i, (a, w) in enumerate(T.WORKS) for j, tpl in enumerate(_HUM_WORK)]
    templated += [PromptItem(key=f"humanities-pair:{i}:{j}", prompt=tpl.format(a=a, b=b))
                  for i, (a, b) in enumerate(T.HUMANITIES_PAIRS) for j, tpl in enumerate(_HUM_PAIR)]
    return list(_alternate([_shuffled(templated, f"{seed}:humanities:templated"),
                            _classified_turns(_HUMANITIES_REQUEST, seed, "humanities")]))
