"""The tools of the hidden-rules task family: their documentation, hidden rules and request generators.

Each :class:`ToolSpec` is one plausible API (BFCL-format documentation, as the student sees it), the
argument its hidden rule governs, the rule's :class:`Variant` s (the seed picks one per tool, see
:func:`draw_rules`), the *documented form* of that argument (what a reader of the docs alone would write,
:attr:`ToolSpec.naive`) and a generator of natural-language requests (:attr:`ToolSpec.draw`).

:data:`RULE_TOOLS` (11) each have a hidden rule; :data:`PLAIN_TOOLS` (4: ``get_weather``,
``add_calendar_note``, ``lookup_contact``, ``track_package``) have none: their documentation is complete
(formats and enum values written out), kind :data:`PLAIN` (``"none"``, which marks a plain tool and is not
a rule kind), one identity variant (:data:`PLAIN_VARIANT`), and the documented form is the accepted one
(:func:`expected_calls` == :func:`format_only_calls`). :data:`TOOLS` is both, the plain tools last.

A request's ``args`` hold the arguments in their *meaning*: ISO dates, Celsius degrees, dollars, hours, digits
of an id or a phone number, lower-case words; the rule's variant turns the governed one into what the API
accepts (:func:`expected_calls`), the documented form into what the docs suggest (:func:`format_only_calls`).
For ``required_argument`` the governed argument is absent from ``args`` (the user never states it); for
``call_first`` it is the ``scope`` of :data:`AUTHENTICATE`, a call that must come before the action.
"""

from __future__ import annotations

import datetime
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lopd_lightning.tasks.bfcl.calls import ToolCall

__all__ = ["AUTHENTICATE", "PLAIN", "PLAIN_TOOLS", "PLAIN_VARIANT", "RULE_KINDS", "RULE_TOOLS", "TOOLS",
           "TOOL_KINDS", "Request", "ToolSpec", "Variant", "all_docs", "draw_rules", "expected_calls",
           "format_only_calls", "offsets_changing", "tool_by_name"]

#: The kinds of hidden rule (each of :data:`RULE_TOOLS` has one).
RULE_KINDS: tuple[str, ...] = ("date_format", "unit", "id_prefix", "enum_spelling", "required_argument", "call_first")

#: The ``kind`` of a plain tool (:data:`PLAIN_TOOLS`): no hidden rule, complete docs. Not a rule kind: a
#: failure on a plain tool never carries ``"rule"`` in its info.
PLAIN = "none"

#: Every ``ToolSpec.kind``: the rule kinds, then :data:`PLAIN`.
TOOL_KINDS: tuple[str, ...] = (*RULE_KINDS, PLAIN)

#: The call that ``call_first`` tools need before the action (shown with every task).
AUTHENTICATE = "authenticate"


@dataclass(frozen=True)
class Variant:
    """One form a hidden rule can take.

    Attributes:
        label: short name ("DD/MM/YYYY", "kelvin", "ORD-").
        rule: the rule in words, as the checker reports it ("date must be written DD/MM/YYYY").
        apply: the argument's meaning (``None`` for ``required_argument`` / ``call_first``) -> the value the
            API accepts.
    """

    label: str
    rule: str
    apply: Callable[[Any], Any]


@dataclass(frozen=True)
class Request:
    """A user's request: the text and the action's arguments in their meaning (JSON values)."""

    text: str
    args: dict[str, Any]


@dataclass(frozen=True)
class ToolSpec:
    """One tool: documentation, hidden rule (kind, governed argument, variants), documented form, requests.

    A plain tool has ``kind`` :data:`PLAIN`, ``argument`` None and the one variant :data:`PLAIN_VARIANT`.
    """

    name: str
    doc: dict[str, Any]
    kind: str
    argument: str | None
    variants: tuple[Variant, ...]
    naive: Callable[[Any], Any]
    draw: Callable[[random.Random], Request]

    @property
    def plain(self) -> bool:
        """No hidden rule: the documented form is the accepted one."""
        return self.kind == PLAIN


def _doc(name: str, description: str, params: dict[str, tuple[str, str]], required: list[str],
         enums: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """A BFCL-format function doc; ``params``: name -> (BFCL type, description)."""
    props: dict[str, Any] = {p: {"type": t, "description": d} for p, (t, d) in params.items()}
    for p, values in (enums or {}).items():
        props[p]["enum"] = list(values)
    return {"name": name, "description": description,
            "parameters": {"type": "dict", "properties": props, "required": list(required)}}


# ------------------------------------------------------------------ the words requests are made of
FIRST = ("Anna", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam",
         "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara")
LAST = ("Smith", "Garcia", "Chen", "Novak", "Okafor", "Rossi", "Muller", "Silva", "Kim", "Dubois", "Haddad",
        "Larsen", "Ivanova", "Patel", "Moreau", "Tanaka", "Walsh", "Kowalski", "Nunez", "Berg")
CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Dublin", "Oslo", "Athens", "Boston",
          "Chicago", "Denver", "Seattle", "Toronto", "Montreal", "Tokyo", "Seoul", "Sydney", "Cairo")
COMPANIES = ("Acme Corp", "Blue Harbor Ltd", "Cedar Labs", "Delta Foods", "Evergreen Media", "Fjord Systems",
             "Granite Works", "Helios Energy", "Iris Design", "Juniper Health", "Kestrel Freight", "Lumen Optics",
             "Maple Bakery", "Nimbus Cloud", "Orchid Studio", "Pioneer Tools", "Quartz Retail", "Redwood Legal",
             "Summit Sports", "Tidal Marine")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
ROOMS = ("living_room", "bedroom", "kitchen", "office", "bathroom", "guest_room", "basement", "nursery")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday")
MEETINGS = ("budget review", "design sync", "hiring panel", "quarterly planning", "sprint retro", "client demo",
            "security audit", "onboarding", "roadmap review", "vendor call", "team lunch", "board prep",
            "incident review", "product launch", "marketing sync", "sales kickoff", "code review", "offsite planning",
            "training session", "one-on-one")
HOURS = {0.5: "half an hour", 1.0: "one hour", 1.5: "an hour and a half", 2.0: "two hours",
         2.5: "two and a half hours", 3.0: "three hours", 4.0: "four hours"}
MESSAGES = ("Running ten minutes late", "Your package has shipped", "See you at noon", "Meeting moved to 3pm",
            "Please call me back", "The report is ready", "Dinner is at seven", "Your table is ready",
            "Happy birthday", "Keys are under the mat")
REASONS = ("damaged", "late", "wrong_item", "not_needed")
REASON_TEXT = {"damaged": "it arrived damaged", "late": "it arrived too late", "wrong_item": "the wrong item was sent",
               "not_needed": "the customer no longer needs it"}
CABINS = ("economy", "premium economy", "business", "first")
TEAMS = ("billing", "network", "support", "security")
TICKETS = ("login page is down", "invoice totals are wrong", "VPN drops every hour", "password reset fails",
           "printer on floor 3 offline", "refund not received", "slow dashboard", "phishing email reported",
           "cannot export reports", "duplicate charges", "Wi-Fi dead in room 12", "API returns 500",
           "certificate expires soon", "customer cannot upload files", "missing order history",
           "two-factor codes not arriving", "mailbox is full", "firewall blocks the CRM", "wrong tax rate",
           "laptop will not boot")
PRIORITIES = ("urgent", "high", "normal", "low")
PRIORITY_TEXT = {"urgent": "an urgent", "high": "a high-priority", "normal": "a normal-priority",
                 "low": "a low-priority"}
ITEMS = ("desk lamp", "office chair", "standing desk", "monitor arm", "keyboard", "mouse", "headset", "webcam",
         "backpack", "water bottle", "notebook", "stapler", "whiteboard", "bookshelf", "filing cabinet", "desk fan",
         "power strip", "footrest", "coat rack", "umbrella")
COLORS = ("black", "white", "red", "blue", "green", "grey", "yellow", "orange", "purple", "silver")
# plain tools
NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven")
TEMPERATURE_UNITS = ("celsius", "fahrenheit")
NOTES = ("Call the plumber", "Renew the passport", "Pick up the dry cleaning", "Pay the electricity bill",
         "Dentist at 9am", "Water the plants", "Send the quarterly report", "Book the vet for Milo",
         "Buy a birthday gift for Sam", "Return the library books", "Car service at 8:30", "Cancel the gym trial",
         "Submit the expense claim", "Parents arrive at noon", "Backup the laptop", "Order printer toner",
         "Team photo day", "Change the smoke alarm battery", "Pay rent", "Call grandma")
CONTACT_FIELDS = ("email", "phone", "address", "job_title")
CONTACT_FIELD_TEXT = {"email": "email address", "phone": "phone number", "address": "postal address",
                      "job_title": "job title"}
CARRIERS = ("ups", "fedex", "dhl", "usps")
CARRIER_TEXT = {"ups": "UPS", "fedex": "FedEx", "dhl": "DHL", "usps": "USPS"}


def _date(rng: random.Random) -> tuple[str, str]:
    """A day of 2025-2026: (ISO string, the way a user says it)."""
    day = datetime.date(2025, 1, 1) + datetime.timedelta(days=rng.randrange(730))
    spoken = (f"{MONTHS[day.month - 1]} {day.day}, {day.year}" if rng.random() < 0.5
              else f"{day.day} {MONTHS[day.month - 1]} {day.year}")
    return day.isoformat(), spoken


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _dollars(rng: random.Random, low: int, high: int) -> tuple[float, str]:
    """An amount in dollars drawn in cents: (value, "$1,234.50")."""
    cents = rng.randint(low, high)
    return round(cents / 100, 2), f"${cents / 100:,.2f}"


def _reformat(fmt: str) -> Callable[[str], str]:
    return lambda iso: datetime.date.fromisoformat(iso).strftime(fmt)


def _dates(argument: str) -> tuple[Variant, ...]:
    return tuple(Variant(label, f"{argument} must be written {label}", _reformat(fmt)) for label, fmt in (
        ("DD/MM/YYYY", "%d/%m/%Y"), ("MM/DD/YYYY", "%m/%d/%Y"), ("YYYYMMDD", "%Y%m%d"), ("DD.MM.YYYY", "%d.%m.%Y")))


def _digits(phone: str) -> str:
    return "".join(ch for ch in phone if ch.isdigit())


def _snake(words: str) -> str:
    return words.upper().replace(" ", "_")


def _camel(words: str) -> str:
    return "".join(w.capitalize() for w in words.split())


def _draw_flight(rng: random.Random) -> Request:
    origin, destination = rng.sample(CITIES, 2)
    iso, spoken = _date(rng)
    person = _person(rng)
    text = rng.choice(("Book a flight for {p} from {o} to {d} on {t}.",
                       "{p} needs to fly from {o} to {d} on {t}; please book it."))
    return Request(text.format(p=person, o=origin, d=destination, t=spoken),
                   {"passenger": person, "origin": origin, "destination": destination, "date": iso})


def _draw_car(rng: random.Random) -> Request:
    city, days = rng.choice(CITIES), rng.randint(1, 14)
    iso, spoken = _date(rng)
    return Request(f"Rent a car in {city}, picked up on {spoken}, for {days} day{'s' if days > 1 else ''}.",
                   {"city": city, "pickup_date": iso, "days": days})


def _draw_thermostat(rng: random.Random) -> Request:
    room, celsius = rng.choice(ROOMS), rng.randint(15, 30)
    return Request(f"Set the {room.replace('_', ' ')} thermostat to {celsius} degrees Celsius.",
                   {"room": room, "temperature": celsius})


def _draw_invoice(rng: random.Random) -> Request:
    company = rng.choice(COMPANIES)
    value, spoken = _dollars(rng, 500, 2_500_000)
    return Request(rng.choice((f"Create an invoice for {company} for {spoken}.", f"Bill {company} {spoken}.")),
                   {"customer": company, "amount": value})


def _draw_meeting(rng: random.Random) -> Request:
    title, day, hours = rng.choice(MEETINGS), rng.choice(WEEKDAYS), rng.choice(tuple(HOURS))
    return Request(f"Schedule the {title} on {day.capitalize()} for {HOURS[hours]}.",
                   {"title": title, "day": day, "duration": hours})


def _draw_sms(rng: random.Random) -> Request:
    phone = f"{rng.randint(201, 989)}-{rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
    message = rng.choice(MESSAGES)
    return Request(f'Text "{message}" to {phone}.', {"phone": phone, "message": message})


def _draw_refund(rng: random.Random) -> Request:
    order, reason = str(rng.randint(10_000, 999_999)), rng.choice(REASONS)
    return Request(f"Refund order {order}: {REASON_TEXT[reason]}.", {"order_id": order, "reason": reason})


def _draw_upgrade(rng: random.Random) -> Request:
    ref = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))
    cabin = rng.choice(CABINS)
    return Request(f"Upgrade booking {ref} to {cabin}.", {"booking_ref": ref, "cabin": cabin})


def _draw_ticket(rng: random.Random) -> Request:
    title, team, priority = rng.choice(TICKETS), rng.choice(TEAMS), rng.choice(PRIORITIES)
    return Request(f'Open {PRIORITY_TEXT[priority]} ticket for the {team} team: "{title}".',
                   {"title": title, "team": team, "priority": priority})


def _draw_inventory(rng: random.Random) -> Request:
    item, color = rng.choice(ITEMS), rng.choice(COLORS)
    return Request(f"How many {color} {item} units do we have in stock?", {"item": item, "color": color})


def _draw_transfer(rng: random.Random) -> Request:
    source, target = (f"{rng.randint(10_000_000, 99_999_999)}" for _ in range(2))
    value, spoken = _dollars(rng, 1_000, 1_000_000)
    return Request(f"Transfer {spoken} from account {source} to account {target}.",
                   {"from_account": source, "to_account": target, "amount": value})


def _draw_weather(rng: random.Random) -> Request:
    city, days, unit = rng.choice(CITIES), rng.randint(1, 7), rng.choice(TEMPERATURE_UNITS)
    span = "tomorrow" if days == 1 else f"the next {NUMBER_WORDS[days - 1]} days"
    text = rng.choice(("What will the weather be like in {c} {o}{s}? Give me the temperatures in {u}.",
                       "I need the {c} forecast for {s}, in degrees {u}."))
    over = "" if days == 1 else "over "
    return Request(text.format(c=city, o=over, s=span, u=unit.capitalize()),
                   {"city": city, "days": days, "unit": unit})


def _draw_note(rng: random.Random) -> Request:
    iso, spoken = _date(rng)
    note = rng.choice(NOTES)
    text = rng.choice(('Add a note to my calendar on {d}: "{n}".', 'Put "{n}" in my calendar for {d}.'))
    return Request(text.format(d=spoken, n=note), {"date": iso, "note": note})


def _draw_contact(rng: random.Random) -> Request:
    person, company, field = _person(rng), rng.choice(COMPANIES), rng.choice(CONTACT_FIELDS)
    text = rng.choice(("What is the {f} of {p} at {c}?", "Look up {p} from {c} and get me their {f}."))
    return Request(text.format(f=CONTACT_FIELD_TEXT[field], p=person, c=company),
                   {"name": person, "company": company, "field": field})


def _tracking_number(rng: random.Random, carrier: str) -> str:
    """A tracking number as the carrier prints it (UPS ``1Z`` + 10 characters, FedEx 12 digits, DHL 10,
    USPS ``9400`` + 8 digits)."""
    prefix, alphabet, length = {"ups": ("1Z", "0123456789ABCDEFGHJKLMNPRSTVWXY", 10), "fedex": ("", "0123456789", 12),
                                 "dhl": ("", "0123456789", 10), "usps": ("9400", "0123456789", 8)}[carrier]
    return prefix + "".join(rng.choice(alphabet) for _ in range(length))


def _draw_package(rng: random.Random) -> Request:
    carrier = rng.choice(CARRIERS)
    number = _tracking_number(rng, carrier)
    text = rng.choice(("Where is my {c} package? The tracking number is {n}.", "Track {c} shipment {n} for me."))
    return Request(text.format(c=CARRIER_TEXT[carrier], n=number), {"carrier": carrier, "tracking_number": number})


def _constant(value: str, rule: str) -> Variant:
    return Variant(value, rule, lambda _unused: value)


#: The tools with a hidden rule, one each.
RULE_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("book_flight", _doc("book_flight", "Book a one-way flight for a passenger.", {
        "passenger": ("string", "the passenger's full name"), "origin": ("string", "the departure city"),
        "destination": ("string", "the arrival city"), "date": ("string", "the day of the flight")},
        ["passenger", "origin", "destination", "date"]), "date_format", "date", _dates("date"), str, _draw_flight),
    ToolSpec("rent_car", _doc("rent_car", "Rent a car.", {
        "city": ("string", "the pick-up city"), "pickup_date": ("string", "the pick-up day"),
        "days": ("integer", "the rental length in days")}, ["city", "pickup_date", "days"]),
        "date_format", "pickup_date", _dates("pickup_date"), str, _draw_car),
    ToolSpec("set_thermostat", _doc("set_thermostat", "Set a room's thermostat.", {
        "room": ("string", "the room"), "temperature": ("float", "the target temperature")},
        ["room", "temperature"], {"room": list(ROOMS)}), "unit", "temperature", (
        Variant("kelvin", "temperature must be in Kelvin", lambda c: round(c + 273.15, 2)),
        Variant("fahrenheit", "temperature must be in degrees Fahrenheit", lambda c: round(c * 9 / 5 + 32, 1)),
        Variant("decicelsius", "temperature must be in tenths of a degree Celsius", lambda c: c * 10)),
        lambda c: c, _draw_thermostat),
    ToolSpec("create_invoice", _doc("create_invoice", "Create an invoice for a customer.", {
        "customer": ("string", "the customer's name"), "amount": ("float", "the amount to bill")},
        ["customer", "amount"]), "unit", "amount", (
        Variant("cents", "amount must be in cents", lambda d: round(d * 100)),
        Variant("mills", "amount must be in mills (thousandths of a dollar)", lambda d: round(d * 1000))),
        lambda d: d, _draw_invoice),
    ToolSpec("schedule_meeting", _doc("schedule_meeting", "Put a meeting in the team calendar.", {
        "title": ("string", "the meeting's title"), "day": ("string", "the weekday"),
        "duration": ("float", "how long the meeting lasts")}, ["title", "day", "duration"], {"day": list(WEEKDAYS)}),
        "unit", "duration", (
        Variant("minutes", "duration must be in minutes", lambda h: round(h * 60)),
        Variant("seconds", "duration must be in seconds", lambda h: round(h * 3600))), lambda h: h, _draw_meeting),
    ToolSpec("send_sms", _doc("send_sms", "Send a text message.", {
        "phone": ("string", "the recipient's phone number"), "message": ("string", "the text to send")},
        ["phone", "message"]), "id_prefix", "phone", (
        Variant("+1", "phone must be +1 followed by the ten digits", lambda p: "+1" + _digits(p)),
        Variant("+1-", "phone must start with the country code, as +1-", lambda p: "+1-" + p)), str, _draw_sms),
    ToolSpec("refund_order", _doc("refund_order", "Refund an order.", {
        "order_id": ("string", "the order's identifier"), "reason": ("string", "why the order is refunded")},
        ["order_id", "reason"], {"reason": list(REASONS)}), "id_prefix", "order_id", tuple(
        Variant(prefix, f"order_id must carry the prefix {prefix!r}", lambda n, p=prefix: p + n)
        for prefix in ("ORD-", "SO-", "#")), str, _draw_refund),
    ToolSpec("upgrade_seat", _doc("upgrade_seat", "Upgrade a booking to another cabin.", {
        "booking_ref": ("string", "the booking reference"), "cabin": ("string", "the new cabin class")},
        ["booking_ref", "cabin"]), "enum_spelling", "cabin", (
        Variant("UPPER_SNAKE", "cabin must be spelled in UPPER_SNAKE_CASE (e.g. PREMIUM_ECONOMY)", _snake),
        Variant("CamelCase", "cabin must be spelled in CamelCase (e.g. PremiumEconomy)", _camel),
        Variant("fare code", "cabin must be its one-letter fare code (Y, W, J, F)",
                lambda w: {"economy": "Y", "premium economy": "W", "business": "J", "first": "F"}[w])),
        str, _draw_upgrade),
    ToolSpec("create_ticket", _doc("create_ticket", "Open a support ticket.", {
        "title": ("string", "a one-line summary"), "team": ("string", "the team that handles it"),
        "priority": ("string", "how urgent it is")}, ["title", "team", "priority"], {"team": list(TEAMS)}),
        "enum_spelling", "priority", (
        Variant("P1-P4", "priority must be P1 (urgent) to P4 (low)", lambda w: f"P{PRIORITIES.index(w) + 1}"),
        Variant("SEV-1..SEV-4", "priority must be SEV-1 (urgent) to SEV-4 (low)",
                lambda w: f"SEV-{PRIORITIES.index(w) + 1}"),
        Variant("UPPER", "priority must be upper case (URGENT, HIGH, NORMAL, LOW)", str.upper)), str, _draw_ticket),
    ToolSpec("query_inventory", _doc("query_inventory", "Count the units of an item in stock.", {
        "item": ("string", "the item"), "color": ("string", "the item's color"),
        "warehouse": ("string", "optional; the warehouse to look in (default: the nearest one)")}, ["item", "color"]),
        "required_argument", "warehouse", tuple(
        _constant(code, f"warehouse must be given (the doc says optional), as {code!r}")
        for code in ("CENTRAL", "WH-01", "main-depot")), lambda _unused: None, _draw_inventory),
    ToolSpec("transfer_funds", _doc("transfer_funds", "Move money between two accounts.", {
        "from_account": ("string", "the account to debit"), "to_account": ("string", "the account to credit"),
        "amount": ("float", "the amount in US dollars")}, ["from_account", "to_account", "amount"]),
        "call_first", "scope", tuple(
        _constant(scope, f"{AUTHENTICATE}(scope={scope!r}) must be called before transfer_funds")
        for scope in ("payments:write", "transfers", "funds.move")), lambda _unused: None, _draw_transfer),
)

#: The one "variant" of a plain tool: the arguments as the request means them, as the docs say.
PLAIN_VARIANT = Variant(PLAIN, "no hidden rule: the documented form is the accepted one", lambda value: value)


def _plain(name: str, doc: dict[str, Any], draw: Callable[[random.Random], Request]) -> ToolSpec:
    return ToolSpec(name, doc, PLAIN, None, (PLAIN_VARIANT,), lambda value: value, draw)


#: The plain tools: complete documentation (every format and enum value written out), no hidden rule.
PLAIN_TOOLS: tuple[ToolSpec, ...] = (
    _plain("get_weather", _doc("get_weather", "Get the daily weather forecast for a city.", {
        "city": ("string", "the city's name"), "days": ("integer", "how many days to forecast, from 1 to 7"),
        "unit": ("string", "the temperature unit of the forecast")}, ["city", "days", "unit"],
        {"unit": list(TEMPERATURE_UNITS)}), _draw_weather),
    _plain("add_calendar_note", _doc("add_calendar_note", "Add a note to a day of the user's calendar.", {
        "date": ("string", "the day, written YYYY-MM-DD (e.g. 2025-03-03)"),
        "note": ("string", "the note's text, as the user gives it")}, ["date", "note"]), _draw_note),
    _plain("lookup_contact", _doc("lookup_contact", "Look up one detail of a contact in the address book.", {
        "name": ("string", "the contact's full name"), "company": ("string", "the company the contact works at"),
        "field": ("string", "the detail to return")}, ["name", "company", "field"],
        {"field": list(CONTACT_FIELDS)}), _draw_contact),
    _plain("track_package", _doc("track_package", "Get the delivery status of a parcel.", {
        "carrier": ("string", "the shipping carrier"),
        "tracking_number": ("string", "the tracking number, exactly as printed on the label")},
        ["carrier", "tracking_number"], {"carrier": list(CARRIERS)}), _draw_package),
)

#: Every tool, in the order requests are drawn round-robin: the rule tools, then the plain ones (4 of 15,
#: so about 27% of the requests of either split are plain).
TOOLS: tuple[ToolSpec, ...] = RULE_TOOLS + PLAIN_TOOLS

#: The documentation of :data:`AUTHENTICATE` (shown with every task; only ``call_first`` tools need it).
AUTHENTICATE_DOC = _doc(AUTHENTICATE, "Authenticate the session for actions that need a permission.", {
    "scope": ("string", "the permission scope to grant")}, ["scope"])


def tool_by_name(name: str) -> ToolSpec:
    """The :data:`TOOLS` entry named ``name``. Raises KeyError for an unknown name."""
    for spec in TOOLS:
        if spec.name == name:
            return spec
    raise KeyError(f"no hidden-rules tool named {name!r}")


def all_docs() -> list[dict[str, Any]]:
    """The documentation of every tool, :data:`AUTHENTICATE` last."""
    return [spec.doc for spec in TOOLS] + [AUTHENTICATE_DOC]


def draw_rules(seed: int, offset: int = 0) -> dict[str, Variant]:
    """Tool name -> its hidden rule's variant, drawn from ``random.Random(f"hidden_rules/{seed}/rules")``;
    a plain tool gets :data:`PLAIN_VARIANT` without a draw (so the rule tools' draws do not depend on them).

    Args:
        seed: the draw's seed.
        offset: each rule tool's variant is the drawn one's index + ``offset``, modulo the tool's number of
            variants (0: the drawn rules). The draws are the same for every offset, so ``offset`` moves each
            tool to another of its variants exactly when it is not a multiple of that tool's count
            (:func:`offsets_changing`).
    """
    rng = random.Random(f"hidden_rules/{seed}/rules")
    rules: dict[str, Variant] = {}
    for spec in TOOLS:
        if spec.plain:
            rules[spec.name] = PLAIN_VARIANT
            continue
        drawn = spec.variants.index(rng.choice(spec.variants))
        rules[spec.name] = spec.variants[(drawn + offset) % len(spec.variants)]
    return rules


def offsets_changing(spec: ToolSpec) -> tuple[int, ...]:
    """The offsets in ``[1, n)`` of :func:`draw_rules` that give ``spec`` each of its other ``n - 1`` variants
    once (n = its number of variants); ``()`` for a plain tool (one variant, nothing to change). Any offset
    congruent to one of them modulo n changes the tool's rule too; a multiple of n keeps it."""
    return tuple(range(1, len(spec.variants)))


def expected_calls(spec: ToolSpec, variant: Variant, args: dict[str, Any]) -> list[ToolCall]:
    """The calls that satisfy the request ``args`` and the hidden rule (a plain tool: the documented form,
    as :func:`format_only_calls`)."""
    action = dict(args)
    if spec.plain:
        return [ToolCall(spec.name, action)]
    if spec.kind == "call_first":
        return [ToolCall(AUTHENTICATE, {"scope": variant.apply(None)}), ToolCall(spec.name, action)]
    action[spec.argument] = variant.apply(args.get(spec.argument))
    return [ToolCall(spec.name, action)]


def format_only_calls(spec: ToolSpec, args: dict[str, Any]) -> list[ToolCall]:
    """The calls a reader of the documentation alone would make: the call format right, the rule broken
    (the documented form of the governed argument; no ``authenticate``; the "optional" argument left out).
    For a plain tool these are the expected calls: the docs are complete."""
    action = dict(args)
    if spec.kind not in ("call_first", "required_argument", PLAIN):
        action[spec.argument] = spec.naive(args[spec.argument])
    return [ToolCall(spec.name, action)]
