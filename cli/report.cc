// `fp8moe report RUN_DIR [RUN_DIR ...] [--out PNG]`: reads each run's
// metrics.jsonl (and summary.json) and draws, with gnuplot, one PNG of four
// panels: training and eval loss of every run (with the synthetic entropy
// floor), step times, the per-expert router load of the first run's first
// layer, and the FP8 health (saturated / flushed fractions) of its quantized
// tensors; when the first run has routed_bias, two more: its first MoE
// layer's bias per expert and every run's load imbalance (max/mean load).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/train.h"

namespace fp8moe::cli {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Run {
  std::string name;
  std::vector<json> steps;
  std::optional<double> floor;
};

bool ReadRun(const std::string& dir, Run* run, std::string* error) {
  const fs::path path = fs::path(dir) / "metrics.jsonl";
  std::ifstream in(path);
  if (!in) {
    *error = "cannot read '" + path.string() + "'; give the directory of a run (it holds metrics.jsonl)";
    return false;
  }
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("step")) run->steps.push_back(std::move(j));
  }
  if (run->steps.empty()) {
    *error = "'" + path.string() + "' holds no steps";
    return false;
  }
  run->name = fs::path(dir).lexically_normal().filename().string();
  if (run->name.empty()) run->name = fs::path(dir).lexically_normal().parent_path().filename().string();
  std::ifstream s(fs::path(dir) / "summary.json");
  if (s) {
    json j = json::parse(s, nullptr, false);
    if (!j.is_discarded() && j.contains("entropy_floor") && j["entropy_floor"].is_number()) {
      run->floor = j["entropy_floor"].get<double>();
    }
  }
  return true;
}

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// A curve per expert of `key` ("expert_load", or routed_bias's
// "router_bias") of the first MoE layer of `run` over its steps (a dense
// layer, first_num_dense_layers, logs an empty list; a step without `key` is
// left out), its data written to `file`. Returns gnuplot's plot list, or ""
// when no step has it.
std::string FirstMoeLayerPlot(const Run& run, const char* key, const fs::path& file) {
  std::ofstream data(file);
  size_t experts = 0;
  for (const json& j : run.steps) {
    if (!j.contains(key)) continue;
    for (const json& layer : j[key]) {
      if (layer.empty()) continue;
      experts = layer.size();
      data << j["step"].get<int64_t>();
      for (const json& v : layer) data << " " << v.get<double>();
      data << "\n";
      break;
    }
  }
  std::string plot;
  for (size_t e = 0; e < experts; ++e) {
    plot += std::string(plot.empty() ? "" : ", ") + Quote(file.string()) + " using 1:" +
            std::to_string(e + 2) + " with lines title 'expert " + std::to_string(e) + "'";
  }
  return plot;
}

// The largest max/mean expert load over the MoE layers of loads [layer][e]
// (a dense layer, first_num_dense_layers, logs an empty load and is left
// out); 0 when there is none.
double WorstImbalance(const std::vector<std::vector<double>>& loads) {
  double worst = 0;
  for (const std::vector<double>& layer : loads) {
    double sum = 0, max = 0;
    for (double v : layer) {
      sum += v;
      max = std::max(max, v);
    }
    if (sum > 0) worst = std::max(worst, max * static_cast<double>(layer.size()) / sum);
  }
  return worst;
}

// Two curves per run of its load imbalance (WorstImbalance): of each step's
// loads (thin: a small batch's loads vary from step to step however
// balanced the router is) and of the loads summed over the last
// kImbalanceWindow steps (thick), with the 1.2 line balancing is judged by;
// data in tmp / "imbalance<r>". Returns gnuplot's plot list, or "" when no
// run logs a load.
constexpr size_t kImbalanceWindow = 50;
std::string LoadImbalancePlot(const std::vector<Run>& runs, const fs::path& tmp) {
  std::string plot;
  for (size_t r = 0; r < runs.size(); ++r) {
    const fs::path file = tmp / ("imbalance" + std::to_string(r));
    std::ofstream data(file);
    std::vector<std::vector<std::vector<double>>> window;  // the last steps' loads
    bool any = false;
    for (const json& j : runs[r].steps) {
      if (!j.contains("expert_load")) continue;
      window.push_back(j["expert_load"].get<std::vector<std::vector<double>>>());
      if (window.size() > kImbalanceWindow) window.erase(window.begin());
      std::vector<std::vector<double>> sum = window.back();
      for (size_t w = 0; w + 1 < window.size(); ++w) {
        for (size_t l = 0; l < sum.size() && l < window[w].size(); ++l) {
          for (size_t e = 0; e < sum[l].size() && e < window[w][l].size(); ++e) {
            sum[l][e] += window[w][l][e];
          }
        }
      }
      const double step = WorstImbalance(window.back());
      if (step == 0) continue;
      data << j["step"].get<int64_t>() << " " << step << " " << WorstImbalance(sum) << "\n";
      any = true;
    }
    if (!any) continue;
    const std::string f = Quote(file.string()), lc = " lc " + std::to_string(r + 1);
    plot += std::string(plot.empty() ? "" : ", ") + f + " using 1:2 with lines lw 0.5" + lc +
            " notitle, " + f + " using 1:3 with lines lw 2.5" + lc + " title " +
            Quote(runs[r].name);
  }
  return plot.empty() ? plot : plot + ", 1.2 with lines dt 2 lc rgb 'black' title '1.2'";
}

}  // namespace

int RunReport(const std::vector<std::string>& dirs, const std::string& out_arg) {
  std::vector<Run> runs(dirs.size());
  for (size_t i = 0; i < dirs.size(); ++i) {
    std::string error;
    if (!ReadRun(dirs[i], &runs[i], &error)) {
      std::fprintf(stderr, "error: %s\n", error.c_str());
      return 2;
    }
  }
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::fprintf(stderr, "error: gnuplot is not installed; run scripts/setup (it installs gnuplot-nox)\n");
    return 2;
  }
  const std::string out = out_arg.empty() ? (fs::path(dirs[0]) / "report.png").string() : out_arg;
  char tmpl[] = "/tmp/fp8moe_report_XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) {
    std::fprintf(stderr, "error: cannot create a temporary directory for the plot data\n");
    return 1;
  }
  const fs::path tmp(tmpl);
  // Data files: per run, loss / eval / time; for the first run, load and health.
  std::string loss_plot, time_plot;
  double ymin = 1e300;
  for (size_t r = 0; r < runs.size(); ++r) {
    std::ofstream loss(tmp / ("loss" + std::to_string(r))), eval(tmp / ("eval" + std::to_string(r))),
        time(tmp / ("time" + std::to_string(r)));
    bool any_eval = false;
    for (const json& j : runs[r].steps) {
      const auto step = j["step"].get<int64_t>();
      if (j.contains("loss") && j["loss"].is_number()) {
        loss << step << " " << j["loss"].get<double>() << "\n";
        ymin = std::min(ymin, j["loss"].get<double>());
      }
      if (j.contains("eval_loss")) {
        eval << step << " " << j["eval_loss"].get<double>() << "\n";
        any_eval = true;
      }
      if (j.contains("step_time_s")) time << step << " " << j["step_time_s"].get<double>() << "\n";
    }
    const std::string name = Quote(runs[r].name);
    loss_plot += std::string(loss_plot.empty() ? "" : ", ") + Quote((tmp / ("loss" + std::to_string(r))).string()) +
                 " with lines lw 1 lc " + std::to_string(r + 1) + " title " + Quote(runs[r].name + " train");
    if (any_eval) {
      loss_plot += ", " + Quote((tmp / ("eval" + std::to_string(r))).string()) +
                   " with linespoints pt 7 ps 0.6 lw 2 lc " + std::to_string(r + 1) + " title " +
                   Quote(runs[r].name + " eval");
    }
    time_plot += std::string(time_plot.empty() ? "" : ", ") + Quote((tmp / ("time" + std::to_string(r))).string()) +
                 " with lines lc " + std::to_string(r + 1) + " title " + name;
  }
  if (runs[0].floor) ymin = std::min(ymin, *runs[0].floor);
  if (runs[0].floor) {
    loss_plot += ", " + std::to_string(*runs[0].floor) + " with lines dt 2 lc rgb 'black' title 'entropy floor'";
  }
  // Router load of the first MoE layer of the first run.
  const std::string load_plot = FirstMoeLayerPlot(runs[0], "expert_load", tmp / "load");
  // FP8 health of the first run that quantizes something: one series per
  // (tensor, saturated|flushed).
  std::string health_plot;
  size_t health_run = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    bool any = false;
    for (const json& j : runs[r].steps) any |= j.contains("fp8_health") && !j["fp8_health"].empty();
    if (any) {
      health_run = r;
      break;
    }
  }
  {
    std::map<std::string, std::ofstream> files;
    for (const json& j : runs[health_run].steps) {
      if (!j.contains("fp8_health")) continue;
      for (auto it = j["fp8_health"].begin(); it != j["fp8_health"].end(); ++it) {
        for (const char* kind : {"saturated", "flushed"}) {
          const std::string key = it.key() + " " + kind;
          auto f = files.find(key);
          if (f == files.end()) {
            const std::string file = (tmp / ("health" + std::to_string(files.size()))).string();
            f = files.emplace(key, std::ofstream(file)).first;
            health_plot += std::string(health_plot.empty() ? "" : ", ") + Quote(file) +
                           " with lines " + (std::string(kind) == "flushed" ? "dt 2 " : "") +
                           "title " + Quote(key);
          }
          f->second << j["step"].get<int64_t>() << " " << (*it)[kind].get<double>() << "\n";
        }
      }
    }
  }
  // routed_bias runs: a third row, each expert's bias of that layer and the
  // load imbalance of every run (so a run without the bias can be compared).
  const std::string bias_plot = FirstMoeLayerPlot(runs[0], "router_bias", tmp / "bias");
  std::ostringstream gp;
  // pngcairo: the libgd png terminal draws every dash type solid.
  gp << "set terminal pngcairo size 1600," << (bias_plot.empty() ? "1100" : "1650")
     << " noenhanced\nset output " << Quote(out) << "\n"
     << "set multiplot layout " << (bias_plot.empty() ? "2" : "3") << ",2 title " << Quote("fp8moe report: " + runs[0].name +
                                                    (runs.size() > 1 ? " and " + std::to_string(runs.size() - 1) + " more" : ""))
     << "\nset grid\nset key top right font ',9'\nset xlabel 'step'\n"
     // A log axis spanning less than a decade gets one labelled tick by
     // default; label the 1-2-5 steps of every decade instead.
     << "set title 'loss (nats/token)'\nset logscale y\nset format y '%g'\n"
     << "set ytics (0.1, 0.2, 0.5, 1, 1.5, 2, 3, 4, 5, 7, 10, 15, 20, 50, 100)\nset mytics 10\n"
     << (ymin > 0 && ymin < 1e300 ? "set yrange [" + std::to_string(0.95 * ymin) + ":*]\n" : "")
     << "plot " << loss_plot << "\nunset logscale y\nset yrange [*:*]\nset ytics autofreq\n"
     << "set mytics default\n"
     << "set title 'step time (s)'\nplot " << time_plot << "\n"
     << "set title " << Quote("router load, first MoE layer of " + runs[0].name + " (fraction of token-expert pairs)")
     << "\n" << (load_plot.empty() ? "plot 0 notitle" : "plot " + load_plot) << "\n"
     << "set title " << Quote("FP8 health of " + runs[health_run].name + " (solid: saturated, dashed: flushed to zero)")
     << "\n" << (health_plot.empty() ? "set label 1 'no quantized tensors' at graph 0.4,0.5\nplot 0 notitle"
                                     : "plot " + health_plot)
     << "\n";
  if (!bias_plot.empty()) {
    gp << "unset label 1\nset title " << Quote("router bias (routed_bias), first MoE layer of " + runs[0].name)
       << "\nplot " << bias_plot << "\n";
    const std::string imbalance_plot = LoadImbalancePlot(runs, tmp);
    gp << "set title 'load imbalance: max/mean expert load, worst MoE layer (thin: each step; "
          "thick: the last " << kImbalanceWindow << " steps)'\nplot "
       << (imbalance_plot.empty() ? "0 notitle" : imbalance_plot) << "\n";
  }
  gp << "unset multiplot\n";
  const fs::path script = tmp / "report.gp";
  std::ofstream(script) << gp.str();
  const std::string cmd = "gnuplot " + Quote(script.string()) + " 2>" + Quote((tmp / "gnuplot.err").string());
  const int rc = std::system(cmd.c_str());
  std::error_code ec;
  if (rc != 0 || !fs::exists(out) || fs::file_size(out, ec) == 0) {
    std::ifstream err(tmp / "gnuplot.err");
    std::stringstream e;
    e << err.rdbuf();
    std::fprintf(stderr, "error: gnuplot failed to draw '%s': %s\n", out.c_str(), e.str().c_str());
    fs::remove_all(tmp, ec);
    return 1;
  }
  fs::remove_all(tmp, ec);
  std::printf("fp8moe report: wrote %s (%zu run%s)\n", out.c_str(), runs.size(), runs.size() > 1 ? "s" : "");
  return 0;
}

}  // namespace fp8moe::cli
