#include "bench/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace shardcast::bench {
namespace {

std::string Num(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f", v);
  return b;
}

std::string Tick(double v) {
  char b[32];
  if (v >= 1000) std::snprintf(b, sizeof(b), "%.0fk", v / 1000);
  else if (v >= 1) std::snprintf(b, sizeof(b), "%.0f", v);
  else std::snprintf(b, sizeof(b), "%g", v);
  return b;
}

}  // namespace

std::string LogLogSvg(const std::string& title, const std::string& x_label, const std::string& y_label,
                      const std::vector<PlotSeries>& series, const std::string& footnote) {
  const double W = 760, H = 480, L = 80, R = 180, T = 40, B = 70;
  double xmin = 1e300, xmax = 0, ymin = 1e300, ymax = 0;
  for (const auto& s : series) {
    for (const auto& p : s.points) {
      xmin = std::min(xmin, p.x), xmax = std::max(xmax, p.x);
      ymin = std::min(ymin, std::max(p.y, 1e-3)), ymax = std::max(ymax, p.y);
    }
  }
  double lx0 = std::floor(std::log10(xmin)), lx1 = std::ceil(std::log10(xmax));
  double ly0 = std::floor(std::log10(ymin)), ly1 = std::ceil(std::log10(ymax));
  if (lx1 <= lx0) lx1 = lx0 + 1;
  if (ly1 <= ly0) ly1 = ly0 + 1;
  auto px = [&](double x) { return L + (std::log10(x) - lx0) / (lx1 - lx0) * (W - L - R); };
  auto py = [&](double y) { return H - B - (std::log10(std::max(y, 1e-3)) - ly0) / (ly1 - ly0) * (H - T - B); };
  static const char* colors[] = {"#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#9467bd", "#8c564b"};
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << title << "</text>\n";
  for (double e = lx0; e <= lx1; ++e) {
    double x = px(std::pow(10, e));
    o << "<line x1=\"" << Num(x) << "\" y1=\"" << T << "\" x2=\"" << Num(x) << "\" y2=\"" << H - B
      << "\" stroke=\"#ddd\"/><text x=\"" << Num(x) << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">"
      << Tick(std::pow(10, e)) << "</text>\n";
  }
  for (double e = ly0; e <= ly1; ++e) {
    double y = py(std::pow(10, e));
    o << "<line x1=\"" << L << "\" y1=\"" << Num(y) << "\" x2=\"" << W - R << "\" y2=\"" << Num(y)
      << "\" stroke=\"#ddd\"/><text x=\"" << L - 6 << "\" y=\"" << Num(y + 4) << "\" text-anchor=\"end\">"
      << Tick(std::pow(10, e)) << "</text>\n";
  }
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - B + 36 << "\" text-anchor=\"middle\">" << x_label << "</text>\n";
  o << "<text transform=\"translate(18," << (T + H - B) / 2 << ") rotate(-90)\" text-anchor=\"middle\">" << y_label
    << "</text>\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    const char* c = colors[i % 6];
    std::vector<PlotPoint> pts = s.points;
    std::sort(pts.begin(), pts.end(), [](const PlotPoint& a, const PlotPoint& b) { return a.x < b.x; });
    o << "<polyline fill=\"none\" stroke=\"" << c << "\" stroke-width=\"2\" points=\"";
    for (const auto& p : pts) o << Num(px(p.x)) << "," << Num(py(p.y)) << " ";
    o << "\"/>\n";
    for (const auto& p : pts) {
      o << "<circle cx=\"" << Num(px(p.x)) << "\" cy=\"" << Num(py(p.y)) << "\" r=\"4.5\" stroke=\"" << c
        << "\" stroke-width=\"2\" fill=\"" << (p.hollow ? "white" : c) << "\"><title>" << p.label << "</title></circle>\n";
    }
    double ly = T + 20 + 22 * static_cast<double>(i);
    o << "<line x1=\"" << W - R + 15 << "\" y1=\"" << ly << "\" x2=\"" << W - R + 40 << "\" y2=\"" << ly
      << "\" stroke=\"" << c << "\" stroke-width=\"2\"/><text x=\"" << W - R + 46 << "\" y=\"" << ly + 4 << "\">"
      << s.name << "</text>\n";
  }
  o << "<text x=\"" << L << "\" y=\"" << H - 10 << "\" font-size=\"11\" fill=\"#555\">" << footnote << "</text>\n";
  o << "</svg>\n";
  return o.str();
}

}  // namespace shardcast::bench
