"""The kinds of draft: distilled small LMs that borrow the target's embeddings and head (distilled), the EAGLE-style
head over the target's features (head), a draft whose forwards run in a process of its own (process, with child as
that process's entry), and where the shipped weights live (shipped)."""
