def methods(sz, rate):
    return [("outer H16 int4", "outer", {"H": 16, "codec": "int4"}),
            ("streaming H16 K4 tau1", "outer", {"H": 16, "codec": "int4", "K": 4, "tau": 1}),
            ("compute only", "compute", None)]
