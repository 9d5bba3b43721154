"""The instructor's tools around grading: the students' download, a generated class, the grading benchmark.

``student_pack`` (the zip students get), ``classroom`` (a class of submissions that know their scores,
for tests and benchmarks), ``grade_bench`` (grade such a class and time it). Nothing here is course
mathematics: students never import it, and the student pack leaves it out.
"""
