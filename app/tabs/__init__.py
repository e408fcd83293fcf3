"""One module per tab (Live, Compare, Replay, How to read this): each builds its UI (create_ui) and wires its
events (create_event_handlers); app/main.py puts them together."""
