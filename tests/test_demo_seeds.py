"""tools/demo_seeds.py --check, with no run: the documented demo figures against a measured run's."""

import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

from tools.demo_seeds import check, compare  # noqa: E402

DOCUMENTED = json.loads((ROOT / "docs" / "demo" / "seeds.json").read_text())


def test_the_check_holds_a_run_to_the_documented_figures_and_says_where_it_parts(tmp_path, capsys):
    documented = DOCUMENTED["runs"][0]
    assert compare(documented, documented) == ([], ["seed 0: the SFT losses and the RL sampled rewards equal the "
                                                    "documented run's, step for step"])
    drifted = copy.deepcopy(documented)
    drifted["sft_loss"][0][1] *= 1 + 1e-5  # another CPU: the first forward's last bits
    drifted["sampled_reward"][2][1] += 1 / 64
    drifted["accuracy_after_rl"] -= 2 / 64
    mismatches, notes = compare(documented, drifted)
    after_rl = documented["accuracy_after_rl"]
    assert mismatches == [f"seed 0: after RL {after_rl - 2 / 64:.3f}, documented {after_rl:.3f}"]
    assert notes == ["seed 0: the SFT loss first differs at step 1 (the first forward: another CPU's kernels or "
                     "another library computed it)", "seed 0: the RL sampled reward first differs at step 3"]
    tiny = copy.deepcopy(documented)
    tiny["sft_loss"][4][1] *= 1 + 1e-8  # within the 1e-6 a loss may move by summation order alone
    assert compare(documented, tiny)[1][0].endswith("step for step")
    assert check(ROOT / "docs" / "demo" / "seeds.json", [drifted]) == 1
    assert check(ROOT / "docs" / "demo" / "seeds.json", [documented]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("the documented figures hold")
