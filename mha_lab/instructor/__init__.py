"""The instructor's tools around grading: the class report of an assignment and the similarity of answers."""
