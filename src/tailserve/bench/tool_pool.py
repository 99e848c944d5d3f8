"""The ``tools`` dataset's functions and the chats that call them.

Twelve function tools of the kinds agents are given (weather, web search, calendar, SQL,
e-mail, stock prices, currency, flights, support tickets, directions, orders, reminders), each
with a JSON-schema ``parameters`` object of 2 to 5 properties: bounded strings, enums, ranged
integers and numbers, patterns for codes and dates, a string list, one nested object. Every
property is required and no others are allowed (OpenAI's ``strict`` function shape), so the
same body is valid on every server.

A request is one user question written for one of the functions (its slots filled from small
lists with the seed), and a tool list of ``--num-tools`` functions that includes it, in a
seeded order. ``tool_choice`` is drawn from ``--tool-choice`` (``auto``, ``required``,
``named``: the question's own function), so a run can mix them or hold one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tailserve.bench import BenchError

Schema = dict[str, Any]
TOOL_CHOICES = ("auto", "required", "named")


def _obj(props: dict[str, Schema]) -> Schema:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def _text(max_length: int) -> Schema:
    return {"type": "string", "maxLength": max_length}


def _enum(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


def _int(low: int, high: int) -> Schema:
    return {"type": "integer", "minimum": low, "maximum": high}


DATE = {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}
TIME = {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}
# Bounded repeats, as a real schema bounds them: a small model in an open ``[a-z.]+`` may
# write "mail.mail.mail..." until max_tokens.
EMAIL = {"type": "string", "pattern": "^[a-z]{1,16}(\\.[a-z]{1,16})?@[a-z]{1,16}\\.[a-z]{2,3}$"}
AIRPORT = {"type": "string", "pattern": "^[A-Z]{3}$"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Schema
    questions: tuple[str, ...]  # str.format templates over SLOTS

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


TOOLS: tuple[Tool, ...] = (
    Tool("get_weather", "The weather forecast for a city",
         _obj({"city": _text(40), "unit": _enum("celsius", "fahrenheit"), "days": _int(1, 7)}),
         ("What will the weather be like in {city} over the next {n} days?",
          "Do I need an umbrella in {city} tomorrow? Give me the temperature in celsius.")),
    Tool("web_search", "Search the web and return the top results",
         _obj({"query": _text(100), "num_results": _int(1, 10),
               "recency": _enum("day", "week", "month", "any")}),
         ("Find the latest news about {topic}.",
          "Search for reviews of {product} from this month.")),
    Tool("create_calendar_event", "Create an event in the user's calendar",
         _obj({"title": _text(60), "date": DATE, "start_time": TIME,
               "duration_minutes": _int(5, 480),
               "attendees": {"type": "array", "items": EMAIL, "maxItems": 5}}),
         ("Schedule a {topic} meeting with {person}@example.com on {date} at {time}.",
          "Put a one-hour call about {topic} in my calendar for {date} at {time}.")),
    Tool("run_sql_query", "Run a read-only SQL query on one of the company databases",
         _obj({"database": _enum("sales", "inventory", "hr"), "query": _text(300),
               "max_rows": _int(1, 1000)}),
         ("How many orders did we ship to {city} last month? Use the sales database.",
          "List the ten products with the lowest stock in the inventory database.")),
    Tool("send_email", "Send an e-mail on the user's behalf",
         _obj({"to": EMAIL, "subject": _text(80), "body": _text(400),
               "cc": {"type": "array", "items": EMAIL, "maxItems": 3}}),
         ("E-mail {person}@example.com that the {topic} review moves to {date}.",
          "Write to {person}@example.com and thank them for the {product} demo.")),
    Tool("get_stock_price", "The latest price of a listed stock",
         _obj({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
               "exchange": _enum("NYSE", "NASDAQ", "LSE")}),
         ("What is {ticker} trading at right now?",
          "Give me the current share price of {ticker} on the NASDAQ.")),
    Tool("convert_currency", "Convert an amount between two currencies at today's rate",
         _obj({"amount": {"type": "number", "minimum": 0, "maximum": 1_000_000_000},
               "from_currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
               "to_currency": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
         ("How much is {n}00 US dollars in euros?",
          "Convert {n}50 pounds to Japanese yen.")),
    Tool("search_flights", "Search flights between two airports on a date",
         _obj({"origin": AIRPORT, "destination": AIRPORT, "date": DATE,
               "passengers": _int(1, 9),
               "cabin": _enum("economy", "premium", "business", "first")}),
         ("Find me a flight from {airport} to {airport2} on {date} for {n} people.",
          "Are there business class seats from {airport} to {airport2} on {date}?")),
    Tool("create_support_ticket", "Open a ticket in the customer support system",
         _obj({"title": _text(80), "description": _text(400),
               "priority": _enum("low", "medium", "high", "urgent"),
               "customer": _obj({"name": _text(40), "email": EMAIL}),
               "tags": {"type": "array", "items": _text(20), "maxItems": 4}}),
         ("{person} ({person}@example.com) says the {product} app crashes on login; "
          "open an urgent ticket.",
          "Log a ticket: {person}@example.com cannot export reports from {product}.")),
    Tool("get_directions", "Directions between two places",
         _obj({"origin": _text(80), "destination": _text(80),
               "mode": _enum("driving", "walking", "transit", "cycling")}),
         ("How do I get from the station to the {city} museum by transit?",
          "Walking directions from my hotel in {city} to the old town, please.")),
    Tool("lookup_order", "Look up a customer order by its id",
         _obj({"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
               "include_items": {"type": "boolean"}}),
         ("Where is my order ORD-{order}?",
          "What was in order ORD-{order}, and has it shipped?")),
    Tool("set_reminder", "Set a reminder for the user",
         _obj({"text": _text(120), "date": DATE, "time": TIME,
               "repeat": _enum("none", "daily", "weekly", "monthly")}),
         ("Remind me to call {person} on {date} at {time}.",
          "Set a weekly reminder to review the {topic} dashboard, starting {date} at {time}.")),
)
BY_NAME = {t.name: t for t in TOOLS}

SLOTS: dict[str, tuple[str, ...]] = {
    "city": ("Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Denver", "Madrid", "Seoul"),
    "topic": ("budget", "hiring", "security", "roadmap", "pricing", "onboarding"),
    "product": ("Atlas", "Nimbus", "Quill", "Orbit", "Beacon"),
    "person": ("maria", "chen", "amara", "lukas", "priya", "omar"),
    "ticker": ("AAPL", "MSFT", "NVDA", "TSLA", "AMZN"),
    "airport": ("JFK", "LHR", "CDG", "NRT", "GRU"),
    "airport2": ("SFO", "FRA", "SIN", "SYD", "MAD"),
    "date": ("2026-12-14", "2027-01-08", "2027-02-21", "2027-03-03"),
    "time": ("09:30", "11:00", "14:15", "16:45"),
    "n": ("2", "3", "4", "5"),
    "order": ("104233", "558120", "730004", "991827"),
}


def parse_tool_choices(spec: str) -> list[str]:
    """``"auto,required,named"`` -> the forms requests draw from (uniformly)."""
    forms = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [f for f in forms if f not in TOOL_CHOICES]
    if not forms or bad:
        raise BenchError(f"--tool-choice wants one or more of {', '.join(TOOL_CHOICES)} "
                         f"separated by commas; got {spec!r}")
    return forms


def tool_choice_value(form: str, name: str) -> Any:
    """The body's ``tool_choice`` for a form (``named``: the question's own function)."""
    if form == "named":
        return {"type": "function", "function": {"name": name}}
    return form


def question(tool: Tool, rng: np.random.Generator) -> str:
    template = tool.questions[int(rng.integers(0, len(tool.questions)))]
    slots = {k: v[int(rng.integers(0, len(v)))] for k, v in SLOTS.items()}
    return template.format(**slots)


def tool_list(target: int, num_tools: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """``num_tools`` functions including ``target``, in a seeded order."""
    others = [i for i in range(len(TOOLS)) if i != target]
    picked = [target, *(int(i) for i in rng.choice(others, num_tools - 1, replace=False))]
    return [TOOLS[picked[int(i)]].openai() for i in rng.permutation(len(picked))]
