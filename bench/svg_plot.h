// bench/svg_plot: a small log-log line plot as standalone SVG, for the README.
#pragma once

#include <string>
#include <vector>

namespace shardcast::bench {

struct PlotPoint {
  double x = 0, y = 0;
  bool hollow = false;  // drawn hollow: an extrapolated figure
  std::string label;
};

struct PlotSeries {
  std::string name;
  std::vector<PlotPoint> points;
};

std::string LogLogSvg(const std::string& title, const std::string& x_label, const std::string& y_label,
                      const std::vector<PlotSeries>& series, const std::string& footnote);

}  // namespace shardcast::bench
