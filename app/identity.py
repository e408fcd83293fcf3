"""Who owns a stored session: a random id that the browser keeps in its localStorage (gr.BrowserState).
A reload is a new Gradio session but the same browser, so it still sees its own private runs; another
browser has another id and sees only its own runs and the shared ones."""

from __future__ import annotations

import os
import re
import secrets

import gradio as gr

STORAGE_KEY = "specbranch-browser-id"
BROWSER_ID = re.compile(r"[0-9a-f]{32}")  # what browser_identity makes: never "local" (the CLI's owner) or the like


def browser_id_state() -> gr.BrowserState:
    """The browser's id in localStorage. Gradio encrypts it there with `secret`, which the page receives
    anyway: SPECBRANCH_BROWSER_SECRET keeps ids readable across server restarts; without it each process
    draws its own secret, and after a restart every browser starts with a new id."""
    return gr.BrowserState(None, storage_key=STORAGE_KEY, secret=os.environ.get("SPECBRANCH_BROWSER_SECRET"))


def browser_identity(stored) -> str:
    """On each page load: the id this browser kept, or a new unguessable one (which the browser then keeps)."""
    return stored if is_browser_id(stored) else secrets.token_hex(16)


def is_browser_id(value) -> bool:
    return isinstance(value, str) and BROWSER_ID.fullmatch(value) is not None


def owner_of(browser_id, request: gr.Request | None) -> str:
    """The owner of what a page stores and sees: its browser's id. Without one (an API client, or an event
    that races the first page load) the Gradio session is the owner, else "anonymous"."""
    if is_browser_id(browser_id):
        return browser_id
    return request.session_hash if request is not None and request.session_hash else "anonymous"
