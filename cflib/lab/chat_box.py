"""The chat box of chat.ipynb in JupyterLab: type a message, watch the answer arrive token by token.

The conversation is kept across turns and rendered whole for every answer
(cflib.lab.chat.ChatSession.reply), as the model saw conversations in
training. Under papermill, nbval or plain Python nothing is built
(frontend_attached says how that is told).
"""
from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from cflib.lab.chat import ChatSession
from cflib.progress import frontend_attached

ROLE_STYLE = {"user": "font-weight: 600", "assistant": "color: var(--jp-brand-color1, #1976d2)",
              "system": "font-style: italic"}


class ChatBox(widgets.VBox):
    """A transcript, a message field (Enter sends) and a button that starts a new conversation."""

    def __init__(self, session: ChatSession, generation: dict[str, Any], system: str | None = None) -> None:
        self.session, self.generation, self.system = session, generation, system
        self.messages: list[dict] = []
        self.transcript = widgets.HTML()
        self.entry = widgets.Text(placeholder="Type a message and press Enter", continuous_update=False,
                                  layout=widgets.Layout(width="70%"))
        self.new_button = widgets.Button(description="New conversation", tooltip="forget the turns so far")
        self.entry.observe(self._entered, names="value")
        self.new_button.on_click(lambda _: self.restart())
        super().__init__([self.transcript, widgets.HBox([self.entry, self.new_button])])
        self.add_class("cflib-chat")
        self.restart()

    def restart(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self._show()

    def send(self, text: str) -> str | None:
        """Add a user turn, stream the answer into the transcript, keep it as the assistant's turn."""
        self.messages.append({"role": "user", "content": text})
        self.entry.disabled = True
        try:
            answer = self.session.reply(self.messages, self.generation, on_text=lambda partial: self._show(partial))
        except ValueError as err:  # a conversation grown past the model's positions, say
            self.messages.pop()
            self._show(error=str(err))
            return None
        finally:
            self.entry.disabled = False
        self.messages.append({"role": "assistant", "content": answer})
        self._show()
        return answer

    def _entered(self, change: dict) -> None:
        text = change["new"].strip()
        if text:
            self.entry.value = ""  # observed again with "", which sends nothing
            self.send(text)

    def _show(self, partial: str | None = None, error: str | None = None) -> None:
        turns = [(m["role"], m["content"]) for m in self.messages]
        if partial is not None:
            turns.append(("assistant", partial + " \u258d"))  # the answer so far, a cursor after it
        lines = [f"<div><span style='{ROLE_STYLE[role]}'>{role}</span>: {html.escape(text)}</div>"
                 for role, text in turns] or ["<div style='opacity: 0.6'>(no messages yet)</div>"]
        if error:
            lines.append(f"<div class='cflib-chat-error' style='color: var(--jp-error-color1, #d32f2f)'>"
                         f"{html.escape(error)}</div>")
        self.transcript.value = "<div class='cflib-chat-transcript'>" + "".join(lines) + "</div>"


def chat_box(session: ChatSession, generation: dict[str, Any], system: str | None = None) -> ChatBox | None:
    """The chat box in JupyterLab; None (nothing shown) where no person is looking."""
    if not frontend_attached():
        print("(the chat box shows when this notebook runs in JupyterLab)")
        return None
    return ChatBox(session, generation, system)
